"""How the S3 tier reaches its store: the obstore client made from a tier entry, where its
credentials come from, and what an error from the store means.

All S3 traffic goes through ``obstore`` (Python bindings of the Rust ``object_store`` crate): its
blocking calls release the GIL while they wait, and its HTTP client keeps connections alive.

Credentials are never in kvtier's configuration. They are looked for where the AWS CLI and SDKs
look, in this order (:func:`credentials`):

1. ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY`` (+ ``AWS_SESSION_TOKEN``) in the environment;
2. a web identity: ``AWS_WEB_IDENTITY_TOKEN_FILE`` + ``AWS_ROLE_ARN`` (EKS service accounts);
3. the shared files, profile ``profile`` (the tier entry's key), else ``AWS_PROFILE``, else
   ``default``: static keys from ``~/.aws/credentials`` (``AWS_SHARED_CREDENTIALS_FILE``) or
   ``~/.aws/config`` (``AWS_CONFIG_FILE``); a profile that assumes a role, signs in with SSO or runs
   a ``credential_process`` is resolved by boto3 (obstore's ``Boto3CredentialProvider``) when boto3
   is installed, else refused with a message saying so;
4. the container's credentials (ECS: ``AWS_CONTAINER_CREDENTIALS_RELATIVE_URI`` / ``_FULL_URI``),
   else the instance's role (IMDSv2).

1, 2 and 4 are object_store's own chain (it reads the environment and asks the metadata endpoints
itself); 3 is read here (the Rust crate reads no shared files). The region: the entry's
``region``, else ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else the profile's, else ``us-east-1``.
Secrets are never logged or printed: :class:`CredentialSource` describes where they came from
and shows at most an access key id's last four characters.

Requests: ``timeout_s`` per request (``connect_timeout_s`` to connect), retried by object_store
at most twice within ``timeout_s`` (100 ms back-off, doubling): a store that does not answer costs
a bounded wait on the tier's own threads, never on the caller's. Errors are sorted by
:func:`classify` into the :class:`Fault` the tier acts on (a miss, a breaker failure, a back-off,
a configuration error).

Threading: :func:`make_store` and :func:`check_access` run on the caller's thread at start-up
(or the tier's monitor thread, for a trial); a store object is thread-safe and shared by every
thread of a tier.
"""

from __future__ import annotations

import configparser
import enum
import logging
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from kvtier.core.text import printable
from kvtier.core.tier_config import S3TierConfig
from kvtier.core.values import PREFIX, ConfigError

logger = logging.getLogger(__name__)

MAX_RETRIES = 2
"""Retries of one request by object_store (connection errors, 5xx, throttling), within ``timeout_s``."""
DEFAULT_REGION = "us-east-1"


class Fault(enum.Enum):
    """What an error from the store means to the tier."""

    NOT_FOUND = "not_found"  # no such object (404): a miss
    REFUSED = "refused"  # credentials or permissions refused (401, 403): a configuration problem
    THROTTLED = "throttled"  # 503 SlowDown, 429: the store asks to slow down (back off)
    UNREACHABLE = "unreachable"  # no answer: refused, reset, timed out, DNS (a breaker failure)
    TLS = "tls"  # the endpoint's certificate is not trusted (ca_bundle): no answer, and a configuration problem
    BAD_RANGE = "bad_range"  # 416: a range of an empty object (a bad object)
    NO_BUCKET = "no_bucket"  # 404 NoSuchBucket
    SERVER = "server"  # any other answer (5xx, 400...): the server answered, the request failed
    BAD_KEY = "bad_key"  # a LIST found a key obstore cannot hold (an empty, "." or ".." segment, which S3
    # allows): the store answered, but that LIST (its page and the rest) is lost; the key must go


@dataclass(frozen=True)
class CredentialSource:
    """Where a tier's credentials come from (never the secret itself): ``description`` for messages,
    ``fix`` for the error that names what to change; ``store_kwargs``: what :func:`make_store` passes
    to obstore for this source (static keys read from the shared files, or a credential provider)."""

    description: str
    fix: str
    store_kwargs: dict[str, Any] = field(default_factory=dict, repr=False)
    region: str | None = None  # the profile's region, if it names one


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _key_hint(key_id: str) -> str:
    return f"...{key_id[-4:]}" if len(key_id) > 8 else "(short)"


def credentials(config: S3TierConfig, where: str) -> CredentialSource:
    """Where ``config``'s credentials come from (see the module docstring); ConfigError naming the
    key when a named profile is missing or cannot be used."""
    env_key = _env("AWS_ACCESS_KEY_ID")
    if env_key and _env("AWS_SECRET_ACCESS_KEY") and config.profile is None:
        return CredentialSource(
            f"the environment (AWS_ACCESS_KEY_ID {_key_hint(env_key)})",
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials) "
            "where the engine runs to an identity the store accepts")
    if _env("AWS_WEB_IDENTITY_TOKEN_FILE") and _env("AWS_ROLE_ARN") and config.profile is None:
        return CredentialSource(f"the web identity of role {os.environ['AWS_ROLE_ARN']}",
                                "check AWS_ROLE_ARN and the role's trust policy and permissions")
    profile = config.profile or _env("AWS_PROFILE") or "default"
    found = _profile(profile)
    if found is not None:
        return _profile_source(profile, found, config, where)
    if config.profile is not None:
        raise ConfigError(f"{PREFIX}: '{where}.profile' names the AWS profile {profile!r}, which is in neither "
                          f"{_shared_file('AWS_SHARED_CREDENTIALS_FILE', 'credentials')} nor "
                          f"{_shared_file('AWS_CONFIG_FILE', 'config')}. Add it there, or remove '{where}.profile'.")
    if _env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI") or _env("AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        return CredentialSource("the container's credentials (ECS task role)", "check the task role's permissions")
    return CredentialSource(
        "the instance's role (IMDS): no AWS_ACCESS_KEY_ID, web identity or shared profile was found",
        "export AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or configure a profile in ~/.aws/credentials "
        "(AWS_PROFILE), or give the instance a role")


def _shared_file(variable: str, name: str) -> Path:
    return Path(os.environ.get(variable) or Path.home() / ".aws" / name).expanduser()


def _profile(profile: str) -> dict[str, str] | None:
    """The settings of ``profile`` from the shared credentials and config files (credentials file
    first, as the AWS CLI reads them), or None where neither has it."""
    merged: dict[str, str] = {}
    found = False
    for variable, name, section in (("AWS_CONFIG_FILE", "config", "default" if profile == "default"
                                     else f"profile {profile}"),
                                    ("AWS_SHARED_CREDENTIALS_FILE", "credentials", profile)):
        parser = configparser.RawConfigParser()
        try:
            parser.read(_shared_file(variable, name), encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError) as exc:
            logger.warning("kvtier s3: cannot read %s: %s", _shared_file(variable, name), type(exc).__name__)
            continue
        if parser.has_section(section):
            found = True
            merged.update({k.lower(): v.strip() for k, v in parser.items(section)})
    return merged if found else None


def _profile_source(profile: str, settings: dict[str, str], config: S3TierConfig, where: str) -> CredentialSource:
    key_id, secret = settings.get("aws_access_key_id"), settings.get("aws_secret_access_key")
    shown = f"profile {profile!r} of the shared AWS files"
    region = settings.get("region")
    if key_id and secret:
        kwargs = {"access_key_id": key_id, "secret_access_key": secret}
        if settings.get("aws_session_token"):
            kwargs["session_token"] = settings["aws_session_token"]
        return CredentialSource(f"{shown} (aws_access_key_id {_key_hint(key_id)})",
                                f"fix aws_access_key_id / aws_secret_access_key of [{profile}] in "
                                f"{_shared_file('AWS_SHARED_CREDENTIALS_FILE', 'credentials')}", kwargs, region)
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        raise ConfigError(
            f"{PREFIX}: '{where}': AWS profile {profile!r} has no static keys (it assumes a role, uses SSO or a "
            "credential_process), which kvtier resolves through boto3; boto3 is not installed. `pip install boto3`, "
            "or export AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, or use a profile with static keys.") from None
    provider = Boto3CredentialProvider(boto3.Session(profile_name=profile))
    return CredentialSource(f"{shown} (through boto3)", f"check profile [{profile}] with `aws sts get-caller-identity "
                            f"--profile {profile}`", {"credential_provider": provider}, region)


def region_of(config: S3TierConfig, source: CredentialSource) -> str:
    return (config.region or _env("AWS_REGION") or _env("AWS_DEFAULT_REGION") or source.region
            or DEFAULT_REGION)


def make_store(config: S3TierConfig, where: str, source: CredentialSource | None = None):
    """The obstore ``S3Store`` of ``config`` (the whole bucket: object keys are full keys), with its
    timeouts, retries, endpoint, addressing and CA bundle. ConfigError when ``ca_bundle`` cannot be
    read or a profile cannot be used. Makes no request."""
    from obstore.store import S3Store

    source = source or credentials(config, where)
    client: dict[str, Any] = {
        "timeout": timedelta(seconds=config.timeout_s),
        "connect_timeout": timedelta(seconds=config.connect_timeout_s),
    }
    if config.endpoint is not None and config.endpoint.startswith("http://"):
        client["allow_http"] = True
    if config.ca_bundle is not None:
        client["root_certificate"] = _ca_bundle(config, where)
    retry = {"max_retries": MAX_RETRIES, "retry_timeout": timedelta(seconds=config.timeout_s),
             "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=1),
                         "base": 2}}
    kwargs = dict(source.store_kwargs)
    provider = kwargs.pop("credential_provider", None)
    s3: dict[str, Any] = {"region": region_of(config, source),
                          "virtual_hosted_style_request": not config.path_style, **kwargs}
    if config.endpoint is not None:
        s3["endpoint"] = config.endpoint
    try:
        return S3Store(config.bucket, config=s3, client_options=client, retry_config=retry,
                       credential_provider=provider)
    except Exception as exc:  # obstore refuses a setting (a bad certificate, half a key pair, ...)
        if "certificate" in str(exc).lower():  # the CA bundle's, not the credentials'
            raise ConfigError(f"{PREFIX}: '{where}.ca_bundle' {str(config.ca_bundle)!r}: {describe(exc)} "
                              f"{_PEM_FIX}") from None
        raise ConfigError(f"{PREFIX}: '{where}' ({config.location}): {describe(exc)}; credentials from "
                          f"{source.description}. Fix: {source.fix}.") from None


_PEM_FIX = "Give the PEM file of the CA certificates that sign the endpoint's certificate."
PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


def _ca_bundle(config: S3TierConfig, where: str) -> bytes:
    """The bytes of ``config.ca_bundle``: ConfigError naming ``ca_bundle`` when it cannot be read or
    holds no PEM certificate (the store's client would refuse it, for want of a certificate, not of
    credentials)."""
    assert config.ca_bundle is not None
    try:
        data = config.ca_bundle.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{PREFIX}: '{where}.ca_bundle' {str(config.ca_bundle)!r} cannot be read: "
                          f"{exc.strerror or exc}.") from None
    if PEM_CERTIFICATE not in data:
        raise ConfigError(f"{PREFIX}: '{where}.ca_bundle' {str(config.ca_bundle)!r} holds no PEM certificate "
                          f"(no {PEM_CERTIFICATE.decode()} line). {_PEM_FIX}")
    return data


_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]{1,80})</Code>")
_MESSAGE = re.compile(r"<Message>([^<]{1,300})</Message>")


def status_of(exc: BaseException) -> int | None:
    """The HTTP status the store answered with, or None (it did not answer)."""
    match = _STATUS.search(str(exc))
    return int(match.group(1)) if match else None


def classify(exc: BaseException) -> Fault:
    """What ``exc`` (from an obstore call) means: see :class:`Fault`."""
    from obstore.exceptions import InvalidPathError, NotFoundError, PermissionDeniedError, UnauthenticatedError

    if isinstance(exc, PermissionDeniedError | UnauthenticatedError):
        return Fault.REFUSED
    if isinstance(exc, InvalidPathError):
        return Fault.BAD_KEY
    text = str(exc)
    if isinstance(exc, NotFoundError | FileNotFoundError):
        return Fault.NO_BUCKET if "NoSuchBucket" in text else Fault.NOT_FOUND
    status = status_of(exc)
    if status is None and "DeleteObjects request failed" in text:  # a bulk DELETE answered, per key
        return Fault.REFUSED if "AccessDenied" in text else Fault.SERVER
    if status is None:
        return Fault.TLS if "InvalidCertificate" in text or "certificate verify failed" in text else Fault.UNREACHABLE
    if status in (401, 403):
        return Fault.REFUSED
    if status == 404:
        return Fault.NO_BUCKET if "NoSuchBucket" in text else Fault.NOT_FOUND
    if status == 416:
        return Fault.BAD_RANGE
    if status in (429, 503) or "SlowDown" in text or "TooManyRequest" in text:
        return Fault.THROTTLED
    return Fault.SERVER


def describe(exc: BaseException) -> str:
    """One line about ``exc`` for logs: the status and the store's error code and message, or the
    client's reason when the store did not answer. Never credentials (obstore's messages hold the
    request's URL, not its signature); control characters escaped (a key or message the store
    chose forges no log line and holds no terminal command: :func:`~kvtier.core.text.printable`)."""
    return printable(_description(exc))


def _description(exc: BaseException) -> str:
    text = str(exc)
    if classify(exc) is Fault.BAD_KEY:
        return (f"the store holds a key kvtier's S3 client cannot list ({text.strip().splitlines()[0][:300]}; "
                "S3 allows empty, '.' and '..' key segments, obstore does not): remove that object "
                "(e.g. aws s3 rm) so that listings of the prefix work again")
    status = status_of(exc)
    code, message = _CODE.search(text), _MESSAGE.search(text)
    if status is not None:
        return " ".join(part for part in (str(status), code.group(1) if code else None,
                                          f"({message.group(1)})" if message else None) if part)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"{type(exc).__name__}: {first[:300]}"


def _tls_reason(exc: BaseException) -> str:
    match = re.search(r"InvalidCertificate\(\s*([A-Za-z]+)", str(exc))
    return f"InvalidCertificate: {match.group(1)}" if match else "certificate verification failed"


_OS_MESSAGE = re.compile(r'message: "([^"]{1,200})"')  # an OS error in the client's report ("Connection refused")
_LOOKUP = re.compile(r'"(failed to lookup address information[^"]{0,200})"')


_FAILED_REQUEST = re.compile(r"Error performing [A-Z]+ (https?://([^/\s]+)(/\S*)?) in ")
_CREDENTIAL_HOSTS = ("169.254.169.254", "[fd00:ec2::254]", "169.254.170.2")  # IMDS (v4, v6), ECS
_IMDS_PATHS = ("/latest/api/token", "/latest/meta-data/")  # (a store's object may live under "latest/")


def credential_fetch_url(exc: BaseException) -> str | None:
    """The host (and port) of the credential service whose request failed in ``exc``, or None where
    the failed request was not one (it went to the store, or the text names no request). object_store
    fetches credentials lazily, inside the first request to the store, and reports a failed fetch as
    that request's error: the instance's role (IMDS, ``/latest/api/token`` or ``/latest/meta-data/``
    on any host: ``AWS_METADATA_ENDPOINT`` may move it), the container's (ECS) or STS (web identity).
    Told apart by the failed request's URL, which object_store's message names."""
    found = _FAILED_REQUEST.search(str(exc))
    if found is None:
        return None
    host, path = found.group(2), found.group(3) or ""
    if (host.split("@")[-1].rsplit(":", 1)[0] in _CREDENTIAL_HOSTS or path.startswith(_IMDS_PATHS)
            or host.split(".")[0] == "sts" or _is_container_uri(found.group(1))):
        return host
    return None


def _is_container_uri(url: str) -> bool:
    full = _env("AWS_CONTAINER_CREDENTIALS_FULL_URI")
    return bool(full) and url.startswith(full.rstrip("/"))


def unreachable_reason(exc: BaseException) -> str:
    """Why the store did not answer (``exc``: a :attr:`Fault.UNREACHABLE` error), in a few words:
    the operating system's reason (``Connection refused``), a failed name lookup, a timeout, else
    the client's last words (``error sending request``). One line, never a credential."""
    text = str(exc)
    for pattern in (_LOOKUP, _OS_MESSAGE):
        found = pattern.search(text)
        if found:
            return found.group(1)
    if "timed out" in text.lower() or "Timeout" in text:
        return "timed out"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first.rsplit(" - ", 1)[-1].strip()[:200]


class StoreUnreachable(Exception):
    """The store did not answer (refused, reset, timed out, no such host), or the service its
    credentials come from did not (:func:`credential_fetch_url`; then the message says so and that
    the store was not asked): ``location`` where the tier's objects are (with the endpoint, or AWS
    S3 and ``region`` where it is known), ``reason`` why (:func:`unreachable_reason`); its message is
    one line."""

    def __init__(self, config: S3TierConfig, exc: BaseException, region: str | None = None) -> None:
        region = region or config.region
        aws = f" at AWS S3{f' ({region})' if region else ''}"
        self.location = config.location + ("" if config.endpoint else aws)
        self.reason = unreachable_reason(exc)
        fetch = credential_fetch_url(exc)
        if fetch is None:
            super().__init__(f"the S3 store of {self.location} does not answer: {self.reason}")
        else:
            super().__init__(f"the credentials for the S3 store of {self.location} cannot be fetched: {fetch} does "
                             f"not answer ({self.reason}); the store itself was not asked")


class Access(enum.Enum):
    OK = "ok"
    UNREACHABLE = "unreachable"


def check_access(config: S3TierConfig, where: str, store=None, source: CredentialSource | None = None) -> Access:
    """List one page under the tier's prefix (what the tier does at start-up). ConfigError naming
    the key to fix when the store refuses the credentials (401/403) or has no such bucket; an
    unreachable store, a throttled or failing one, is no such error (:attr:`Access.UNREACHABLE`
    or OK: the tier starts and misses). Blocks for at most about ``timeout_s``."""
    return Access.OK if _first_page(config, where, store, source) is None else Access.UNREACHABLE


def require_access(config: S3TierConfig, where: str, store=None, source: CredentialSource | None = None) -> None:
    """:func:`check_access` for a caller that needs the store at once (the operator tools): a store
    that does not answer raises :class:`StoreUnreachable` instead of being reported as
    :attr:`Access.UNREACHABLE`; ConfigError as there."""
    source = source or credentials(config, where)
    unreachable = _first_page(config, where, store, source)
    if unreachable is not None:
        raise StoreUnreachable(config, unreachable, region_of(config, source))


def _first_page(config: S3TierConfig, where: str, store, source: CredentialSource | None) -> BaseException | None:
    """List one page under the prefix: the error if the store did not answer (else None: it
    answered, even with a failure, logged); ConfigError as :func:`check_access` says."""
    import obstore

    source = source or credentials(config, where)
    store = store if store is not None else make_store(config, where, source)
    try:
        next(iter(obstore.list(store, config.prefix + "/", chunk_size=1)), None)
    except Exception as exc:  # noqa: BLE001 (sorted below; anything else is the store answering badly)
        fetch = credential_fetch_url(exc)
        if fetch is not None and status_of(exc) is not None:  # the credential service answered: no credentials
            raise ConfigError(
                f"{PREFIX}: '{where}' ({config.location}): no credentials to sign the store's requests: fetching "
                f"them failed ({fetch}: {describe(exc)}; credentials from {source.description}), so the store "
                f"itself was not asked. Fix: {source.fix}.") from None
        if fetch is not None:  # it did not answer: as a store that does not, the tier starts and misses
            logger.warning("kvtier s3: the credentials for %s cannot be fetched: %s does not answer (%s); the "
                           "store itself was not asked", config.location, fetch, unreachable_reason(exc))
            return exc
        fault = classify(exc)
        if fault is Fault.REFUSED:
            raise ConfigError(
                f"{PREFIX}: '{where}' ({config.location}): the store refuses the credentials from "
                f"{source.description}: {describe(exc)}. Fix: {source.fix}; the identity needs s3:ListBucket on the "
                f"bucket and s3:GetObject, s3:PutObject, s3:DeleteObject on {config.prefix}/*.") from None
        if fault is Fault.NO_BUCKET:
            raise ConfigError(f"{PREFIX}: '{where}.url': the store has no bucket {config.bucket!r}"
                              f"{' at ' + config.endpoint if config.endpoint else ''} ({describe(exc)}). Create it, "
                              f"or fix the bucket in '{where}.url' (and '{where}.endpoint', "
                              f"'{where}.region').") from None
        if fault is Fault.TLS:
            raise ConfigError(f"{PREFIX}: '{where}.ca_bundle': the certificate of {config.endpoint} is not trusted "
                              f"({_tls_reason(exc)}). Give the PEM file of the CA that signed it as "
                              f"'{where}.ca_bundle'"
                              f"{' (now ' + str(config.ca_bundle) + ')' if config.ca_bundle else ''}, or fix "
                              f"'{where}.endpoint'.") from None
        if fault is Fault.UNREACHABLE:
            return exc
        logger.warning("kvtier s3: %s answered the start-up LIST with %s; starting anyway", config.location,
                       describe(exc))
    return None
