"""Tenants: one API key each, with a name (for metrics and logs; the key itself is never logged nor shown) and
optional limits on concurrent requests, requests per minute and tokens per minute.

Where they come from (:meth:`TenantRegistry.from_config`): ``--api-keys-file`` (JSON, see :func:`load_keys_file`)
and ``--api-key`` (repeatable; one key is tenant ``default``, several are ``key-1``, ``key-2``, ...). The
``--tenant-*`` flags are the limits of every tenant that does not set its own.

Keys are compared in constant time: the presented token's SHA-256 against every tenant's, with no early exit.
Limits are checked when a generation request arrives (:meth:`TenantRegistry.admit`): requests in flight, requests
in the last 60 s, and tokens (prompt + generated) charged in the last 60 s; over any of them the request gets 429
with ``Retry-After`` (the seconds until it would pass) and OpenAI's ``x-ratelimit-*`` headers. Tokens are
charged when a request finishes (the registry observes the engine), so a tenant may overshoot its tokens per
minute by the requests in flight when it reaches it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from leanserve.engine.llm_engine import EngineStats
from leanserve.errors import InvalidParameterError
from leanserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

TENANT_KEY = "leanserve.tenant"  # ASGI scope key: the authenticated Tenant (None: no or a wrong key)
WINDOW_S = 60.0
LIMIT_FIELDS = ("max_concurrent", "requests_per_minute", "tokens_per_minute")
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


@dataclass(frozen=True)
class TenantLimits:
    """Limits of one tenant; None: unlimited."""

    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


@dataclass
class Tenant:
    """One API key's owner. ``key_digest`` (SHA-256 of the key) is all that is kept of the key."""

    name: str
    key_digest: bytes = field(repr=False)
    limits: TenantLimits = field(default_factory=TenantLimits)
    in_flight: int = 0
    _requests: deque[float] = field(default_factory=deque, repr=False)  # arrival times in the window
    _tokens: deque[tuple[float, int]] = field(default_factory=deque, repr=False)  # (finish time, tokens)
    _tokens_in_window: int = 0


@dataclass(frozen=True)
class RateLimited:
    """Why a request was refused: which limit, its value, and when to retry."""

    tenant: str
    limit: str  # "max_concurrent" | "requests_per_minute" | "tokens_per_minute"
    value: int
    used: int
    retry_after: int  # whole seconds, >= 1

    @property
    def message(self) -> str:
        what = {"max_concurrent": "concurrent requests", "requests_per_minute": "requests per minute (RPM)",
                "tokens_per_minute": "tokens per minute (TPM)"}[self.limit]
        return (f"Rate limit reached for tenant {self.tenant} on {what}: Limit {self.value}, Used {self.used}. "
                f"Please try again in {self.retry_after}s.")

    @property
    def type(self) -> str:
        return "tokens" if self.limit == "tokens_per_minute" else "requests"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _check_limit(where: str, name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParameterError("api_keys_file", f"{where}: {name} must be an integer >= 1, got {value!r}")
    return value


def load_keys_file(path: str, defaults: TenantLimits) -> list[tuple[str, str, TenantLimits]]:
    """The tenants of an ``--api-keys-file``: a JSON list (or ``{"tenants": [...]}``) of objects with ``name``,
    ``key`` and optionally ``max_concurrent``, ``requests_per_minute``, ``tokens_per_minute``.

    Raises:
        InvalidParameterError("api_keys_file"): unreadable file, bad JSON or a bad entry (the message names the
            entry by index and name, never its key).
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise InvalidParameterError("api_keys_file", f"cannot read api_keys_file {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidParameterError("api_keys_file", f"api_keys_file {path} is not valid JSON: {exc}") from None
    if isinstance(data, dict) and "tenants" in data:
        data = data["tenants"]
    if not isinstance(data, list) or not data:
        raise InvalidParameterError("api_keys_file", f"api_keys_file {path} must hold a non-empty JSON list of "
                                    "tenants")
    out = []
    for i, entry in enumerate(data):
        where = f"api_keys_file entry {i}"
        if not isinstance(entry, dict):
            raise InvalidParameterError("api_keys_file", f"{where} must be a JSON object")
        unknown = sorted(set(entry) - {"name", "key", *LIMIT_FIELDS})
        if unknown:
            raise InvalidParameterError("api_keys_file", f"{where}: unknown field {unknown[0]!r}")
        name, key = entry.get("name"), entry.get("key")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidParameterError("api_keys_file", f"{where}: name must be 1-64 letters, digits or _.@-")
        where += f" ({name})"
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            raise InvalidParameterError("api_keys_file", f"{where}: key must be a non-empty string without "
                                        "surrounding spaces")
        limits = TenantLimits(**{n: _check_limit(where, n, entry.get(n, getattr(defaults, n)))
                                 for n in LIMIT_FIELDS})
        out.append((name, key, limits))
    return out


class TenantRegistry:
    """The server's tenants: authentication, limits, and the per-tenant accounting.

    Args:
        tenants: (name, key, limits) per tenant; names and keys must be unique.
        metrics: the per-tenant metrics (:class:`~leanserve.entrypoints.openai.metrics.TenantMetrics`), or None.
        clock: ``time.monotonic`` (tests pass their own).

    Thread-safety: :meth:`admit` / :meth:`release` run on the event loop, :meth:`on_step` on the engine thread;
    one lock guards the windows.
    """

    def __init__(self, tenants: list[tuple[str, str, TenantLimits]], metrics: Any = None, clock=time.monotonic
                 ) -> None:
        if not tenants:
            raise ValueError("no tenants")
        names = [n for n, _, _ in tenants]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise InvalidParameterError("api_keys_file", f"tenant name {dup!r} is used twice")
        self.tenants = [Tenant(n, _digest(k), lim) for n, k, lim in tenants]
        digests = [t.key_digest for t in self.tenants]
        for t in self.tenants:
            if digests.count(t.key_digest) > 1:
                raise InvalidParameterError("api_keys_file", f"tenant {t.name!r} shares its key with another tenant")
        self.by_name = {t.name: t for t in self.tenants}
        self.metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._owners: dict[str, Tenant] = {}  # engine request id -> tenant, until it finishes

    @classmethod
    def from_config(cls, api_keys: list[str], api_keys_file: str | None, defaults: TenantLimits,
                    metrics: Any = None) -> TenantRegistry | None:
        """The tenants of ``--api-key`` (repeatable) and ``--api-keys-file``; None when there is no key at all.

        Raises:
            InvalidParameterError: a bad keys file, duplicate names or keys.
        """
        tenants = load_keys_file(api_keys_file, defaults) if api_keys_file else []
        if len(api_keys) == 1:
            tenants.append(("default", api_keys[0], defaults))
        else:
            tenants += [(f"key-{i + 1}", k, defaults) for i, k in enumerate(api_keys)]
        return cls(tenants, metrics) if tenants else None

    # ----------------------------------------------------------------------------------------- authentication
    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer KEY`` header value, or None (constant time in the key)."""
        scheme, _, token = (authorization or "").partition(" ")
        digest = _digest(token.strip())
        found = None
        for t in self.tenants:  # no early exit: the time does not depend on which key (if any) matched
            if hmac.compare_digest(digest, t.key_digest):
                found = t
        if scheme.lower() != "bearer":
            return None
        return found

    # ----------------------------------------------------------------------------------------------- limits
    def admit(self, tenant: Tenant) -> RateLimited | None:
        """Count a new generation request of ``tenant`` against its limits: None (admitted: in flight until
        :meth:`release`) or why not."""
        now = self._clock()
        lim = tenant.limits
        with self._lock:
            self._expire(tenant, now)
            refusal = None
            if lim.max_concurrent is not None and tenant.in_flight >= lim.max_concurrent:
                refusal = RateLimited(tenant.name, "max_concurrent", lim.max_concurrent, tenant.in_flight, 1)
            elif lim.requests_per_minute is not None and len(tenant._requests) >= lim.requests_per_minute:
                oldest = tenant._requests[len(tenant._requests) - lim.requests_per_minute]
                refusal = RateLimited(tenant.name, "requests_per_minute", lim.requests_per_minute,
                                      len(tenant._requests), _seconds(oldest + WINDOW_S - now))
            elif lim.tokens_per_minute is not None and tenant._tokens_in_window >= lim.tokens_per_minute:
                used, wait = tenant._tokens_in_window, 1.0
                for t, n in tenant._tokens:  # the time until enough charged tokens leave the window
                    used -= n
                    wait = t + WINDOW_S - now
                    if used < lim.tokens_per_minute:
                        break
                refusal = RateLimited(tenant.name, "tokens_per_minute", lim.tokens_per_minute,
                                      tenant._tokens_in_window, _seconds(wait))
            if refusal is None:
                tenant.in_flight += 1
                tenant._requests.append(now)
        if refusal is not None:
            logger.info("tenant %s: 429, %s limit %d reached", tenant.name, refusal.limit, refusal.value)
            if self.metrics is not None:
                self.metrics.rate_limited(tenant.name, refusal.limit)
        elif self.metrics is not None:
            self.metrics.request_admitted(tenant.name)
        return refusal

    def release(self, tenant: Tenant) -> None:
        """The request :meth:`admit` let in has ended (its response was sent, or the client left)."""
        with self._lock:
            tenant.in_flight -= 1
        if self.metrics is not None:
            self.metrics.request_done(tenant.name)

    def remaining(self, tenant: Tenant) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for ``tenant`` (only the limits it has)."""
        lim, headers = tenant.limits, {}
        with self._lock:
            self._expire(tenant, self._clock())
            if lim.requests_per_minute is not None:
                headers["x-ratelimit-limit-requests"] = str(lim.requests_per_minute)
                headers["x-ratelimit-remaining-requests"] = str(max(0, lim.requests_per_minute
                                                                    - len(tenant._requests)))
            if lim.tokens_per_minute is not None:
                headers["x-ratelimit-limit-tokens"] = str(lim.tokens_per_minute)
                headers["x-ratelimit-remaining-tokens"] = str(max(0, lim.tokens_per_minute
                                                                  - tenant._tokens_in_window))
        return headers

    def _expire(self, tenant: Tenant, now: float) -> None:
        while tenant._requests and tenant._requests[0] <= now - WINDOW_S:
            tenant._requests.popleft()
        while tenant._tokens and tenant._tokens[0][0] <= now - WINDOW_S:
            tenant._tokens_in_window -= tenant._tokens.popleft()[1]

    # ------------------------------------------------------------------------------------------- accounting
    def track(self, request_id: str, tenant: Tenant) -> None:
        """Charge engine request ``request_id``'s tokens to ``tenant`` when it finishes."""
        with self._lock:
            self._owners[request_id] = tenant

    def untrack(self, request_id: str) -> None:
        """Forget a request that never reached the engine."""
        with self._lock:
            self._owners.pop(request_id, None)

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        """Engine observer (engine thread): charge every finished request's prompt and generated tokens."""
        now = None
        for out in outputs:
            if not out.finished:
                continue
            with self._lock:
                tenant = self._owners.pop(out.request_id, None)
                if tenant is None:
                    continue
                prompt = len(out.prompt_token_ids)
                generated = sum(len(o.token_ids) for o in out.outputs)
                now = now if now is not None else self._clock()
                tenant._tokens.append((now, prompt + generated))
                tenant._tokens_in_window += prompt + generated
            logger.debug("tenant %s: request %s ended (%s): %d prompt + %d generated tokens", tenant.name,
                         out.request_id, out.outputs[0].finish_reason if out.outputs else None, prompt, generated)
            if self.metrics is not None:
                self.metrics.tokens(tenant.name, prompt, generated)

    @property
    def num_tracked(self) -> int:
        with self._lock:
            return len(self._owners)


def _seconds(s: float) -> int:
    return max(1, math.ceil(s))
