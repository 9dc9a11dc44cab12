"""The validating admission webhook: the operator's own verdict (`reconcile.judge`) at `kubectl apply` time.

The refusal text is the message the `Compatible=False` condition would carry, so a user sees the same words
whether the webhook or the operator stopped the spec. Importing this module registers the kopf handler; the
CLI imports it only when a webhook is served. Two ways to serve it:
- in a cluster (the Helm chart): HTTPS with the chart's certificate files; the chart owns the
  ValidatingWebhookConfiguration, which calls the path `/validate-disaggdeployment`;
- in development and tests: kopf's own server on 127.0.0.1 with a self-signed certificate, and kopf manages
  the configuration. kopf's built-in certificate generation (certbuilder/oscrypto) fails on OpenSSL >= 3.0.10,
  so the certificate is made with `cryptography`.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import kopf

from disagg.operator.api import GROUP, PLURAL, VERSION
from disagg.operator.reconcile import judge

HANDLER_ID: Final = "validate-disaggdeployment"


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
def validate(spec: kopf.Spec, **_: Any) -> None:
    message = refusal(dict(spec))
    if message is not None:
        raise kopf.AdmissionError(message, code=422)


def cluster_webhook(port: int, cert_dir: Path) -> Webhook:
    """HTTPS on every interface with the mounted certificate; the chart's configuration points at it."""
    server = kopf.WebhookServer(
        addr="0.0.0.0", port=port, certfile=cert_dir / "tls.crt", pkeyfile=cert_dir / "tls.key"
    )
    return Webhook(server=server, managed=None)


def dev_webhook(port: int, managed: str) -> Webhook:
    """kopf's server on 127.0.0.1 with a self-signed certificate; kopf writes the configuration `managed`."""
    return Webhook(
        server=SelfSignedWebhookServer(addr="127.0.0.1", port=port, host="127.0.0.1"), managed=managed
    )


class SelfSignedWebhookServer(kopf.WebhookServer):
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
