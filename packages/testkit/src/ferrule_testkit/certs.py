"""TLS certificates made at run time, for tests of TLS and mutual TLS (needs `cryptography`)."""

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate signed by another CA
    rogue_key: Path


def make_certs(folder: Path) -> Certs:
    """Write a CA, a server certificate for 127.0.0.1 / localhost (signed by it), a client
    certificate (signed by it) and a rogue client certificate (signed by another CA) into
    `folder`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def write(name: str, key, cert) -> tuple[Path, Path]:
        cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert_path, key_path

    def issue(name, issuer_key, issuer_name, *, ca=False, usage=None, sans=()):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        return key, builder.sign(issuer_key or key, hashes.SHA256())

    ca_key, ca_cert = issue("ferrule test CA", None, None, ca=True)
    server_key, server_cert = issue(
        "localhost",
        ca_key,
        ca_cert.subject,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    client_key, client_cert = issue(
        "trainer", ca_key, ca_cert.subject, usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    rogue_ca_key, rogue_ca = issue("rogue CA", None, None, ca=True)
    rogue_key, rogue_cert = issue(
        "intruder", rogue_ca_key, rogue_ca.subject, usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    ca_path, _ = write("ca", ca_key, ca_cert)
    return Certs(
        ca_path,
        *write("server", server_key, server_cert),
        *write("client", client_key, client_cert),
        *write("rogue", rogue_key, rogue_cert),
    )
