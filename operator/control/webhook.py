"""The validating admission webhook: the operator's own verdict (`reconcile.judge`) at `kubectl apply` time.

The refusal text is the message the `Compatible=False` condition would carry, so a user sees the same words
whether the webhook or the operator stopped the spec. Importing this module registers the kopf handler; the
CLI imports it only when a webhook is served. Two ways to serve it:
- in a cluster (the Helm chart): HTTPS with the chart's certificate files; the chart owns the
  ValidatingWebhookConfiguration, which calls the path `/validate-disaggdeployment`;
- in development and tests: kopf's own server on 127.0.0.1 with a self-signed certificate, and kopf manages
  the configuration. kopf's built-in certificate generation (certbuilder/oscrypto) fails on OpenSSL >= 3.0.10,
  so the certificate is made with `cryptography`.

Both servers read the request body themselves (`GuardedWebhookServer`) before kopf sees it: kopf answers 500
to a body that is not UTF-8, JSON nested past the interpreter's recursion limit, or a review without
`request`. Here each of those is a 400 with a reason, or, once the review's uid is known, a well-formed
denial; and a verdict that raises is a denial too, never a 500.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aiohttp.web
import kopf

from disagg.operator.api import GROUP, PLURAL, VERSION, nested_deeper_than, old_spellings
from disagg.operator.control.reconcile import judge

HANDLER_ID: Final = "validate-disaggdeployment"
# The paths the server answers, one per handler id (`/<id>`, as kopf's managed configuration and the chart's
# name them). kopf routes `/{id:.*}` and runs the handlers whose id matches, so on any other path (`/`, `/x`)
# it ran none and allowed the request: every write would pass a webhook called on a mistyped path.
SERVED_HANDLER_IDS: Final = frozenset({HANDLER_ID})
# An AdmissionReview nests the object a few levels below its top; DisaggDeployment's free-form fields are
# bounded at 32 levels (api.MAX_FREE_FORM_DEPTH), so nothing valid comes near this.
MAX_REVIEW_DEPTH: Final = 100
REVIEW_API_VERSIONS: Final = ("admission.k8s.io/v1", "admission.k8s.io/v1beta1")
_LOG = logging.getLogger("disagg.operator.control.webhook")
# kopf's WebhookFn: the parsed review and the request's context in, the response review out.
ReviewFn = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Webhook:
    """What the startup handler hands to kopf: the server, and the configuration kopf manages (if any)."""

    server: kopf.WebhookServer
    managed: str | None


def refusal(spec: Mapping[str, Any]) -> str | None:
    """The message a spec is refused with, or None when it is accepted."""
    verdict = judge(spec)
    return verdict.message if verdict.violations else None


@kopf.on.validate(GROUP, VERSION, PLURAL, id=HANDLER_ID, operations=["CREATE", "UPDATE"])
def validate(spec: kopf.Spec, warnings: list[str] | None = None, **_: Any) -> None:
    # kopf passes the review's warnings, which kubectl prints ("Warning: ...") and still applies the object.
    if warnings is not None:
        warnings.extend(old_spellings(dict(spec)))
    try:
        message = refusal(dict(spec))
    except Exception as error:  # kopf would answer 500 and the user would see only the exception's text
        _LOG.exception("The verdict on a DisaggDeployment spec failed")
        raise kopf.AdmissionError(
            f"VerdictFailed: the operator could not judge this spec ({type(error).__name__}), so it refuses "
            "it; run `disagg check` on the file and report the spec",
            code=422,
        ) from error
    if message is not None:
        raise kopf.AdmissionError(message, code=422)


def _envelope_problem(request: Mapping[str, Any]) -> str | None:
    """What kopf needs of `review.request` and this review lacks (kopf would raise a KeyError on it)."""
    resource = request.get("resource")
    if not isinstance(resource, dict) or not all(
        isinstance(resource.get(key), str) for key in ("group", "version", "resource")
    ):
        return "request.resource must name the group, version and resource under review"
    if not isinstance(request.get("userInfo"), dict):
        return "request.userInfo is missing"
    if not any(isinstance(request.get(key), dict) for key in ("object", "oldObject")):
        return "request.object (or request.oldObject) is missing"
    return None


def _denial(review: Mapping[str, Any], uid: str, message: str) -> dict[str, Any]:
    version = review.get("apiVersion")
    return {
        "apiVersion": version if version in REVIEW_API_VERSIONS else REVIEW_API_VERSIONS[0],
        "kind": "AdmissionReview",
        "response": {"uid": uid, "allowed": False, "status": {"code": 400, "message": message}},
    }


async def review_response(
    fn: ReviewFn, body: bytes, **context: Any
) -> tuple[int, dict[str, Any] | None, str]:
    """(HTTP status, response review or None, reason) for one request body. A body that is no review is a
    400 with the reason; a review whose uid is known is answered with a denial when it cannot be judged."""
    try:
        review = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as error:
        return (
            400,
            None,
            f"MalformedAdmissionReview: the body is not UTF-8 ({error.reason} at byte {error.start})",
        )
    except RecursionError:
        return 400, None, "MalformedAdmissionReview: the body is nested too deeply"
    except ValueError as error:
        return 400, None, f"MalformedAdmissionReview: the body is not JSON ({str(error)[:200]})"
    if nested_deeper_than(review, MAX_REVIEW_DEPTH):
        return 400, None, f"MalformedAdmissionReview: the body is nested more than {MAX_REVIEW_DEPTH} levels"
    request = review.get("request") if isinstance(review, dict) else None
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        return 400, None, "MalformedAdmissionReview: the body is no AdmissionReview with request.uid"
    problem = _envelope_problem(request)
    if problem is not None:
        message = f"MalformedAdmissionReview: {problem}"
        return 200, _denial(review, request["uid"], message), message
    try:
        response: dict[str, Any] = await fn(review, **context)
    except Exception as error:  # kopf's own refusals (a resource it does not serve) and anything unforeseen
        _LOG.exception("Serving an admission review failed")
        message = f"VerdictFailed: the operator could not judge this review ({type(error).__name__}: {error})"
        return 200, _denial(review, request["uid"], message), message
    return 200, response, "reviewed"


class GuardedWebhookServer(kopf.WebhookServer):
    """kopf's server with the request body read and checked here (see the module's docstring)."""

    @staticmethod
    async def _serve(fn: ReviewFn, request: aiohttp.web.Request) -> aiohttp.web.Response:
        handler = request.match_info.get("id")
        if handler not in SERVED_HANDLER_IDS:
            # Not a review anyone may rely on: 404, so the API server fails the call (and, with the chart's
            # failurePolicy Fail, the write) instead of reading "allowed".
            return aiohttp.web.Response(
                status=404, text=f"NoSuchWebhook: {request.path[:200]!r} names no admission handler"
            )
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        status, review, reason = await review_response(
            fn,
            await request.read(),
            webhook=handler,
            sslpeer=peer,
            headers=dict(request.headers),
        )
        if review is None:
            return aiohttp.web.Response(status=status, text=reason)
        return aiohttp.web.json_response(review)


def cluster_webhook(port: int, cert_dir: Path) -> Webhook:
    """HTTPS on every interface with the mounted certificate; the chart's configuration points at it."""
    server = GuardedWebhookServer(
        addr="0.0.0.0", port=port, certfile=cert_dir / "tls.crt", pkeyfile=cert_dir / "tls.key"
    )
    return Webhook(server=server, managed=None)


def dev_webhook(port: int, managed: str) -> Webhook:
    """kopf's server on 127.0.0.1 with a self-signed certificate; kopf writes the configuration `managed`."""
    return Webhook(
        server=SelfSignedWebhookServer(addr="127.0.0.1", port=port, host="127.0.0.1"), managed=managed
    )


class SelfSignedWebhookServer(GuardedWebhookServer):
    @staticmethod
    def build_certificate(hostnames: Collection[str], password: str | None = None) -> tuple[bytes, bytes]:
        """A self-signed CA:TRUE leaf with every hostname as a SAN (Go ignores the CN): its own caBundle."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        sans: list[x509.GeneralName] = []
        for hostname in hostnames:
            try:
                address = ipaddress.ip_address(hostname)
            except ValueError:
                sans.append(x509.DNSName(hostname))
                continue
            if not address.is_unspecified:
                sans.append(x509.IPAddress(address))
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, next(iter(hostnames), "localhost"))])
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256())
        )
        encryption: serialization.KeySerializationEncryption = (
            serialization.BestAvailableEncryption(password.encode())
            if password
            else serialization.NoEncryption()
        )
        return (
            certificate.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption),
        )
