"""A request's fields that no model declares (protocol.unknown_fields): ignored, as vLLM ignores
them, but said so: one warning per request and the X-Ignored-Fields response header; or, with
`--reject-unknown-fields`, refused with a 400 that names them."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from pydantic import BaseModel

from tandem.serve.errors import bad_request
from tandem.serve.protocol import unknown_fields

log = logging.getLogger("tandem.serve.api")

HEADER = "X-Ignored-Fields"
# A body may carry any number of made-up keys of any length; the header and the log line stay short.
MAX_NAMED, MAX_NAME_CHARS = 16, 64


# A name shown as it is: what an API's field paths are made of (`messages[].x`). Nothing here can end a
# header value or a log line, or be mistaken for the list's separator or a quoted name.
_PLAIN = re.compile(r"[A-Za-z0-9_.\[\]$@:/+-]+")


def _shown(name: str) -> str:
    """A client's field name for the header and the log line: as it is when plain, else as a JSON
    string in ASCII (`"x "`, `""`, `"a\\nb"`, `"\\u00e9"`), so that empty names, edge spaces, control
    and non-ASCII characters can neither make the header invalid (h11 refuses it: no response at
    all) nor forge log lines. At most MAX_NAME_CHARS characters of it, an escape never cut."""
    if _PLAIN.fullmatch(name):
        return name[:MAX_NAME_CHARS]
    shown = ""
    for char in name:
        escaped = json.dumps(char)[1:-1]
        if len(shown) + len(escaped) > MAX_NAME_CHARS:
            break
        shown += escaped
    return f'"{shown}"'


@dataclass(frozen=True)
class UnknownFields:
    reject: bool = False  # --reject-unknown-fields

    def check(self, body: BaseModel, rid: str) -> dict[str, str]:
        """The headers the response carries: none when every field is known."""
        found = unknown_fields(body)
        if not found:
            return {}
        names = [_shown(name) for name in found[:MAX_NAMED]]
        listed = ", ".join(names) + (f" (and {len(found) - MAX_NAMED} more)" if len(found) > MAX_NAMED else "")
        if self.reject:
            raise bad_request(f"unknown fields: {listed} (the server runs with --reject-unknown-fields)", names[0])
        log.warning("request %s: ignored unknown fields: %s", rid, listed)
        return {HEADER: ", ".join(names)}
