"""The one allowlisting unpickler, as the readers use it. Every pickle goes through `load` (vm.py);
what it accepts is policy.py, what it builds standins.py, its per-file state context.py, and how
what it built becomes extras extras.py. docs/security.md, "The allowlists", lists what each format
accepts.
"""
from .context import Context
from .extras import Ref, extras_json, key_text, recorded_digest
from .policy import (CODE_LAST, CODE_MODULES, CODE_NAMES, CODE_PARTS, SAFE_BUILTINS, Allowlist, Placeholder, Unlisted,
                     allow_globals, allowing, hint, listing, record_parts, runs_code, unread_in)
from .standins import (BENIGN, PAYLOAD_MIN, Function, InertClass, InertObject, Marker, Payload, StandIn, StateDict,
                       as_buffer)
from .memo import fetched_memo
from .vm import load, load_prefix

__all__ = ["BENIGN", "CODE_LAST", "CODE_MODULES", "CODE_NAMES", "CODE_PARTS", "PAYLOAD_MIN", "SAFE_BUILTINS",
           "Allowlist", "Context", "Function", "InertClass", "InertObject", "Marker", "Payload", "Placeholder", "Ref",
           "StandIn", "StateDict", "Unlisted", "allow_globals", "allowing", "as_buffer", "extras_json",
           "fetched_memo", "hint", "key_text", "listing", "load", "load_prefix", "record_parts", "recorded_digest",
           "runs_code", "unread_in"]
