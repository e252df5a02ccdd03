"""Object-store URLs: which text is one, what it names, and the store that reaches it (obstore).

`s3://BUCKET/KEY`, `gs://BUCKET/KEY`, `az://CONTAINER/PATH` (the account from
AZURE_STORAGE_ACCOUNT_NAME) and `abfs[s]://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH`. A URL never
carries credentials: userinfo with a password, a query string (a SAS token, a presigned signature)
or a fragment is refused without being repeated. Credentials come the way each ecosystem finds them
(obstore reads the environment, web identity, container and instance credentials; for S3 without
AWS_ACCESS_KEY_ID in the environment and boto3 installed, boto3's whole chain, config files and
profiles included). An endpoint (`--endpoint-url`, else AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL)
points S3 requests at an S3-compatible store, and GCS requests (`--endpoint-url`, else GOOGLE_BASE_URL)
at another GCS endpoint (an emulator); plain http is allowed only for an endpoint given so.

Every message that can leave this package goes through `failure`/`redact`: one line, no query
strings, no value of a credential variable (docs/security.md, "Bounds").
"""
import os
import random
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional
from urllib.parse import urlsplit

from ..errors import UsageError, printable

EXTRA = "ckptconv[cloud]"
SCHEMES = ("s3", "gs", "az", "abfs", "abfss")
MIB = 1 << 20

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,254}$")   # S3 and GCS names (Azure containers are a subset)
_ACCOUNT = re.compile(r"^[a-z0-9]{3,24}$")
# environment variables whose values are credentials: never printed (matched by name)
_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|CREDENTIAL|ACCESS_KEY|ACCOUNT_KEY|SAS|SIGNATURE|_KEY$", re.I)


@dataclass(frozen=True)
class StorageOptions:
    """How ckptconv talks to an object store. Reads: `concurrency` ranged GETs of `part_size` bytes
    ahead of the consumer (memory: (concurrency + 1) x part_size); each GET retried on transient
    failures at most `retries` times within `retry_seconds`, waiting `backoff_seconds` doubled each
    time (at most 15 s, jittered); a read that delivers nothing for `stall_seconds` has failed.
    Uploads: parts of at least `part_size` (more when an object would need over 10,000), at most
    `upload_concurrency` in flight, retried by obstore within the same budget."""

    endpoint_url: Optional[str] = None
    concurrency: int = 16
    part_size: int = 16 * MIB
    upload_concurrency: int = 8
    retries: int = 10
    retry_seconds: float = 180.0
    backoff_seconds: float = 0.1
    stall_seconds: float = 30.0

    def __post_init__(self):
        for name in ("concurrency", "upload_concurrency"):
            if not isinstance(getattr(self, name), int) or not 1 <= getattr(self, name) <= 256:
                raise UsageError(f"{name}: must be a whole number from 1 to 256")
        if not isinstance(self.part_size, int) or not 64 << 10 <= self.part_size <= 5 << 30:
            raise UsageError("part size: must be from 64 KiB to 5 GiB")
        if not isinstance(self.retries, int) or not 0 <= self.retries <= 100:
            raise UsageError("retries: must be a whole number from 0 to 100")
        for name in ("retry_seconds", "backoff_seconds", "stall_seconds"):
            if not 0 < getattr(self, name) <= 86400:
                raise UsageError(f"{name.replace('_', ' ')}: must be more than 0 and at most a day")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (1, 2, ...): exponential, capped, jittered."""
        return min(self.backoff_seconds * 2 ** (attempt - 1), 15.0) * random.uniform(0.5, 1.0)


@dataclass(frozen=True)
class Location:
    """One object, or a prefix ("directory") when `key` names one, in a bucket or container."""

    scheme: str                    # as written: s3, gs, az, abfs, abfss
    bucket: str                    # the bucket, or the Azure container
    key: str = ""                  # no leading or trailing "/"; "" is the bucket's root
    account: Optional[str] = None  # the Azure storage account an abfs URL names

    def __str__(self) -> str:
        where = f"{self.bucket}@{self.account}.dfs.core.windows.net" if self.account else self.bucket
        return f"{self.scheme}://{where}/{self.key}"

    @property
    def kind(self) -> str:
        """The store's kind: s3, gs or az."""
        return "az" if self.scheme in ("abfs", "abfss") else self.scheme

    def child(self, name: str) -> "Location":
        """The object `name` (relative, "/"-separated) under this prefix."""
        _check_key(name, name)
        return Location(self.scheme, self.bucket, f"{self.key}/{name}" if self.key else name, self.account)

    def sibling(self, name: str) -> "Location":
        """The object `name` beside this one (in the same "directory")."""
        parent = self.key.rpartition("/")[0]
        return Location(self.scheme, self.bucket, f"{parent}/{name}" if parent else name, self.account)


def is_url(text) -> bool:
    """Whether `text` is a URL (any `scheme://`): never to be opened as a local path."""
    return isinstance(text, str) and bool(_URL.match(text))


def _check_key(key: str, shown: str):
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts) or not key.isprintable():
        raise UsageError(f"{printable(shown)}: an object path must be plain names separated by single '/' "
                         "(no empty, '.' or '..' parts, no control characters)")


def parse(url: str) -> Location:
    """`url` as a Location; UsageError naming what is wrong (never repeating a credential)."""
    if not is_url(url):
        raise UsageError(f"{printable(url)}: not a URL (scheme://...)")
    if not url.isprintable():   # (urlsplit would drop a tab or newline silently: another key)
        raise UsageError(f"{printable(url, 300)}: a storage URL may not hold control characters")
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise UsageError(f"{printable(scheme)}://...: not a storage URL ckptconv reads or writes "
                         f"({', '.join(s + '://' for s in SCHEMES)})")
    parts = urlsplit(url)
    shown = f"{scheme}://{parts.hostname or ''}{parts.path}"
    if "?" in url or "#" in url:
        raise UsageError(f"{printable(shown)}: a storage URL may not carry a query or fragment (a SAS token or "
                         "signature belongs in the environment, not on the command line)")
    if parts.password is not None or (parts.username is not None and scheme not in ("abfs", "abfss")):
        raise UsageError(f"{printable(shown)}: a storage URL may not carry credentials; give them the way "
                         "the store's tools read them (environment, config files, instance identity)")
    host, account = parts.netloc, None
    if scheme in ("abfs", "abfss"):
        m = re.fullmatch(r"([^@/]+)@([a-z0-9]+)\.dfs\.core\.windows\.net", host)
        if not m:
            raise UsageError(f"{printable(shown)}: an abfs URL is abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PATH")
        host, account = m.groups()
        if not _ACCOUNT.match(account):
            raise UsageError(f"{printable(shown)}: {printable(account)} is not an Azure storage account name")
    if not _BUCKET.match(host):
        raise UsageError(f"{printable(shown)}: {printable(host) or 'no bucket'} is not a bucket or container name")
    key = parts.path.strip("/")
    if key:
        _check_key(key, shown)
    return Location(scheme, host, key, account)


_ENDPOINT_VARIABLES = {"s3": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"), "gs": ("GOOGLE_BASE_URL",)}


def endpoint(options: StorageOptions, kind: str = "s3") -> Optional[str]:
    """The endpoint of a store of `kind` (s3, gs) given explicitly: the option, else (S3)
    AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, (GCS) GOOGLE_BASE_URL, obstore's own name; checked: http
    or https, a host, nothing else that could hold a secret."""
    given = options.endpoint_url or next(filter(None, map(os.environ.get, _ENDPOINT_VARIABLES[kind])), None)
    if not given:
        return None
    parts = urlsplit(given)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"endpoint {printable(parts.scheme)}://{printable(parts.hostname or '')}: "
                         "an endpoint URL is http(s)://HOST[:PORT]")
    if parts.username is not None or parts.query or parts.fragment:
        raise UsageError(f"endpoint {parts.scheme}://{printable(parts.hostname)}: an endpoint URL may not carry "
                         "credentials, a query or a fragment")
    return given.rstrip("/")


def obstore_module():
    """obstore, or UsageError naming the extra that installs it."""
    try:
        import obstore
    except ImportError:
        raise UsageError(f"object-store URLs need the optional client library: pip install '{EXTRA}'") from None
    return obstore


def _boto3_credentials():
    """boto3's credential provider for obstore (the whole AWS chain, config files and profiles
    included), when boto3 is installed and the environment gives no key of its own."""
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        return None, None
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None, None
    session = boto3.Session()
    if session.get_credentials() is None:
        return None, None   # nothing there: obstore's own chain (instance identity) still applies
    return Boto3CredentialProvider(session), session.region_name


@dataclass(frozen=True)
class Store:
    """A store reaching one bucket, with the options it was opened with. Its obstore handle is
    never shown (repr=False); credentials live inside obstore, never in ckptconv's objects."""

    location: Location
    options: StorageOptions
    handle: Any = field(repr=False, compare=False)


def open_store(location: Location, options: StorageOptions = StorageOptions(), retries: Optional[int] = None) -> Store:
    """A store for `location`'s bucket. `retries` overrides the obstore client's own retry count
    (readers retry ranged GETs themselves and pass 0)."""
    obstore_module()
    from obstore.store import AzureStore, GCSStore, S3Store
    # A whole request may take an hour (an upload's 5 GiB part); a read, what a part takes at 256 KiB/s
    # more than its stall timeout: a server that trickles bytes, never stalling for --stall-timeout,
    # cannot hold a ranged GET (nor a process that a signal stopped, waiting for it) for longer.
    whole = 3600 if retries is None else options.stall_seconds + options.part_size / (256 << 10)
    client = {"allow_http": False, "read_timeout": timedelta(seconds=options.stall_seconds),
              "connect_timeout": timedelta(seconds=min(options.stall_seconds, 30)),
              "timeout": timedelta(seconds=whole)}
    retry = {"max_retries": options.retries if retries is None else retries,
             "retry_timeout": timedelta(seconds=options.retry_seconds),
             "backoff": {"init_backoff": timedelta(seconds=options.backoff_seconds),
                         "max_backoff": timedelta(seconds=15), "base": 2}}
    try:
        if location.kind == "s3":
            config = {}
            url = endpoint(options)
            if url:
                config["endpoint"] = url
                client["allow_http"] = url.startswith("http://")
            provider, region = _boto3_credentials()
            if region and not (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")):
                config["region"] = region
            handle = S3Store(location.bucket, config=config, client_options=client, retry_config=retry,
                             credential_provider=provider)
        elif location.kind == "gs":
            config = {}
            url = endpoint(options, "gs")
            if url:   # (an emulator, a private endpoint: obstore's base URL)
                config["base_url"] = url
                client["allow_http"] = url.startswith("http://")
            handle = GCSStore(location.bucket, config=config, client_options=client, retry_config=retry)
        elif options.endpoint_url:
            raise UsageError(f"{location}: --endpoint-url applies to s3:// and gs:// URLs only")
        else:
            config = {"account_name": location.account} if location.account else {}
            handle = AzureStore(location.bucket, config=config, client_options=client, retry_config=retry)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"{location}: cannot open the store: {failure(e)}") from None
    return Store(location, options, handle)


_QUERY = re.compile(r"\?[^\s\"'<>]*")
_XML_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")
_STATUS = re.compile(r"status code: (\d{3})")
_ANSWER = re.compile(r"status code: (\d{3}[^:\n]*)")
_KINDS = {"PermissionDeniedError": "permission denied", "UnauthenticatedError": "not authenticated",
          "PreconditionError": "precondition failed", "AlreadyExistsError": "already exists",
          "FileNotFoundError": "not found"}


def secrets() -> list:
    """The values of this process's credential variables (8 characters or more), longest first."""
    found = {v for k, v in os.environ.items() if _SECRET_NAME.search(k) and len(v) >= 8}
    return sorted(found, key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with query strings cut and every credential variable's value replaced by `***`."""
    return hide_secrets(_QUERY.sub("?…", str(text)))


def hide_secrets(text: str) -> str:
    """`text` with every credential variable's value replaced by `***` (every error the command line
    prints passes through this)."""
    text = str(text)
    for value in secrets():
        text = text.replace(value, "***")
    return text


_HTTP_KIND = {"Connect": "cannot connect", "Timeout": "timed out", "Interrupted": "the connection was cut",
              "Decode": "its answer could not be read", "Request": "the request failed"}
_OS_MESSAGE = re.compile(r'message: "([^"]{1,80})"')
_HTTP_KIND_AT = re.compile(r"HttpError \{\s*kind: (\w+)")
_OBSTORE_PREFIX = re.compile(r"^(Generic \w+ error: )?(Error performing [\w ]+ request: )?"
                             r"(Error performing \w+ \S+ in [^-]*- )?")


def failure(e: BaseException) -> str:
    """A store client's error as part of one line: the server's answer when there was one ("the server
    answered HTTP 503 Service Unavailable (SlowDown)"), else what happened to the connection ("cannot
    connect (Connection refused)"), else the client's first line without its prefixes; redacted,
    bounded. obstore's messages go on with a response body and a debug dump: never shown."""
    text = str(e) or type(e).__name__
    code, answered = _XML_CODE.search(text), _ANSWER.search(text)
    if answered:   # "... Server returned non-2xx status code: 503 Service Unavailable: <?xml ..."
        kind = _KINDS.get(type(e).__name__)
        first = (f"{kind}: " if kind else "") + f"the server answered HTTP {answered.group(1).strip()}"
        first += f" ({code.group(1)})" if code else ""
    elif _HTTP_KIND_AT.search(text):
        first = _HTTP_KIND.get(_HTTP_KIND_AT.search(text).group(1), "the request failed")
        os_message = _OS_MESSAGE.search(text)
        first += f" ({os_message.group(1)})" if os_message else ""
    else:
        first = _OBSTORE_PREFIX.sub("", text.split("\n", 1)[0]) or text.split("\n", 1)[0]
    return printable(redact(first), 400)


def status(e: BaseException) -> Optional[int]:
    """The HTTP status an obstore error reports in its text, if any (obstore's exceptions carry no
    status of their own: "... Server returned non-2xx status code: 503 Service Unavailable ...")."""
    m = _STATUS.search(str(e))
    return int(m.group(1)) if m else None


def transient(e: BaseException) -> bool:
    """Whether a failed request may succeed if tried again: connection resets, timeouts, stalls, 5xx,
    408 and 429 (SlowDown). A definite answer (missing, forbidden, precondition, bad request) is not."""
    import obstore.exceptions as ox
    if isinstance(e, (FileNotFoundError, ox.PreconditionError, ox.NotModifiedError, ox.PermissionDeniedError,
                      ox.UnauthenticatedError, ox.InvalidPathError, ox.NotSupportedError, ox.AlreadyExistsError,
                      ox.UnknownConfigurationKeyError)):
        return False
    code = status(e)
    return code is None or code >= 500 or code in (408, 429)


class Retry:
    """One operation's retry budget: at most `options.retries` retries, none starting later than
    `options.retry_seconds` after the first attempt."""

    def __init__(self, options: StorageOptions):
        self.options, self.attempt, self.started = options, 0, time.monotonic()

    def again(self) -> bool:
        """After a transient failure: wait and say True when another attempt fits in the budget."""
        self.attempt += 1
        wait = self.options.backoff(self.attempt)
        if self.attempt > self.options.retries or time.monotonic() + wait - self.started > self.options.retry_seconds:
            return False
        time.sleep(wait)
        return True

    def spent(self) -> str:
        return f"{self.attempt} attempt{'s' if self.attempt != 1 else ''} in {time.monotonic() - self.started:.1f} s"
