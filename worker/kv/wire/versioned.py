"""One struct per message kind, many connector versions: `VersionedStruct` derives, from a struct whose
fields carry their `Since` lifetime and from the connector version table, every version's field set, its
encoder, the decoder, the refusal to write a value an older version has no field for, the version check and
the field-set-to-version lookup.

In memory a message is always the struct's full field set (every field any known version has). A version's
field set is the fields present at it, in declaration order, which is wire order: msgspec writes a struct as
a map keyed by field name in that order with every default written out, exactly as vLLM's classes do. The
decoder, like vLLM's, takes every field set (unknown keys are ignored, missing defaulted ones filled), so a
decoded message re-encodes byte for byte at the version it came from.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import msgspec

from disagg.worker.kv.wire.limits import check_size, decode_typed, quote
from disagg.worker.kv.wire.versions import VERSIONS, ConnectorVersion, Since, check_table, spoken_numbers

S = TypeVar("S", bound=msgspec.Struct)


def _since_of(hint: Any) -> Since | None:
    marks = [mark for mark in getattr(hint, "__metadata__", ()) if isinstance(mark, Since)]
    if len(marks) > 1:
        raise TypeError(f"a field has one lifetime, got {marks}")
    return marks[0] if marks else None


class VersionedStruct(Generic[S]):
    """A msgspec struct's wire form at each connector version of `table`.

    Every field without a `Since` is on the wire at every version; one with a `Since` must have a default,
    because a peer of a version without it does not send it, and must join (or leave) at a version the table
    has, so that a field added without its release row fails at import rather than on the wire.
    """

    def __init__(
        self,
        struct: type[S],
        table: Sequence[ConnectorVersion] = VERSIONS,
        *,
        what: str,
        noun: str,
    ) -> None:
        check_table(table)
        self.struct = struct
        self.table = tuple(table)
        self.versions = spoken_numbers(table)
        self.latest = self.versions[-1]
        self._what, self._noun = what, noun
        numbers = {row.number for row in self.table}
        hints = typing.get_type_hints(struct, include_extras=True)
        self._infos = msgspec.structs.fields(struct)
        self._hints = {info.name: hints[info.name] for info in self._infos}
        self._since: dict[str, Since] = {}
        for info in self._infos:
            since = _since_of(self._hints[info.name])
            if since is None:
                continue
            if info.required:
                raise TypeError(
                    f"{struct.__name__}.{info.name} is not on the wire at every connector version, so it "
                    "needs a default (a peer of a version without it does not send it)"
                )
            for bound in (since.version, since.until):
                if bound is not None and bound not in numbers:
                    raise ValueError(
                        f"{struct.__name__}.{info.name} changes at connector version {bound}, which the "
                        f"version table ({', '.join(map(str, sorted(numbers)))}) has no row for"
                    )
            self._since[info.name] = since
        self._structs = {number: self._derive(number) for number in self.versions}
        field_sets: dict[tuple[str, ...], tuple[int, ...]] = {}
        for row in self.table:
            names = self.fields_present_at(row.number)
            field_sets[names] = (*field_sets.get(names, ()), row.number)
        self._field_sets = field_sets

    def fields_present_at(self, connector_version: int) -> tuple[str, ...]:
        """The field names, in wire order, that the struct has at any connector version (spoken or not)."""
        return tuple(
            info.name
            for info in self._infos
            if (since := self._since.get(info.name)) is None or since.present_at(connector_version)
        )

    def _derive(self, connector_version: int) -> type[msgspec.Struct]:
        names = self.fields_present_at(connector_version)
        if len(names) == len(self._infos):
            return self.struct
        config = self.struct.__struct_config__
        fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
        for info in self._infos:
            if info.name not in names:
                continue
            hint = self._hints[info.name]
            if info.default is not msgspec.NODEFAULT:
                fields.append((info.name, hint, info.default))
            elif info.default_factory is not msgspec.NODEFAULT:
                fields.append((info.name, hint, msgspec.field(default_factory=info.default_factory)))
            else:
                fields.append((info.name, hint))
        return msgspec.defstruct(
            f"{self.struct.__name__}V{connector_version}",
            fields,
            module=self.struct.__module__,
            frozen=config.frozen,
            omit_defaults=config.omit_defaults,
            array_like=config.array_like,
            forbid_unknown_fields=config.forbid_unknown_fields,
        )

    def struct_at(self, connector_version: int) -> type[msgspec.Struct]:
        """The struct whose fields, in order, are the message at that (spoken) connector version."""
        try:
            return self._structs[connector_version]
        except KeyError:
            raise ValueError(
                f"NIXL connector version {connector_version} is not one this worker speaks "
                f"(it speaks {', '.join(map(str, self.versions))})"
            ) from None

    def fields_at(self, connector_version: int) -> tuple[str, ...]:
        """The field names in wire order at that (spoken) connector version."""
        fields: tuple[str, ...] = self.struct_at(connector_version).__struct_fields__
        return fields

    def _row(self, number: int) -> ConnectorVersion:
        return next(row for row in self.table if row.number == number)

    def _why_absent(self, since: Since, connector_version: int) -> str:
        if connector_version < since.version:
            # The first release that has the field: a main-only version's field ships with the next release.
            row = next(
                (r for r in self.table if r.number >= since.version and r.release is not None),
                self._row(since.version),
            )
            where = "a later vLLM" if row.release_line is None else f"vLLM {row.release_line}"
            return f"{since.needed_by} needs {where} (connector version {row.number}) or later"
        return f"connector version {since.until} dropped it"

    def _default(self, name: str) -> Any:
        info = next(info for info in self._infos if info.name == name)
        return info.default_factory() if info.default is msgspec.NODEFAULT else info.default

    def encode(self, message: S, connector_version: int) -> bytes:
        """The message as that connector version's vLLM encodes it: its field set, in its order. A value
        that version has no field for is refused unless it is the default (which is what a peer of that
        version would read anyway)."""
        struct = self.struct_at(connector_version)
        if struct is self.struct:
            return msgspec.msgpack.encode(message)
        for name, since in self._since.items():
            if since.present_at(connector_version):
                continue
            value = getattr(message, name)
            if value != self._default(name):
                raise ValueError(
                    f"connector version {connector_version} has no {name}, but this {self._noun} sets it "
                    f"to {quote(value)}: {self._why_absent(since, connector_version)}"
                )
        return msgspec.msgpack.encode(
            struct(**{name: getattr(message, name) for name in struct.__struct_fields__})
        )

    def decode(self, data: bytes) -> S:
        """Any known version's field set, size-checked and typed; every refusal is a `WireFormatError`."""
        return decode_typed(data, self.struct, self._what, self.versions)

    def field_set_versions(self, data: bytes) -> tuple[int, ...]:
        """The connector versions (of the table, spoken or not) whose field set, in order, is exactly the
        keys of the encoded map; empty when it is no known field set or no msgpack map."""
        check_size(data, self._what)
        try:
            keys = tuple(msgspec.msgpack.decode(data, type=dict[str, Any]))
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return ()
        return self._field_sets.get(keys, ())
