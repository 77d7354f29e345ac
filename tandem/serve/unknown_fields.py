"""A request's fields that no model declares (protocol.unknown_fields): ignored, as vLLM ignores
them, but said so: one warning per request and the X-Ignored-Fields response header; or, with
`--reject-unknown-fields`, refused with a 400 that names them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pydantic import BaseModel

from tandem.serve.errors import bad_request
from tandem.serve.protocol import unknown_fields

log = logging.getLogger("tandem.serve.api")

HEADER = "X-Ignored-Fields"
# A body may carry any number of made-up keys of any length; the header and the log line stay short.
MAX_NAMED, MAX_NAME_CHARS = 16, 64


@dataclass(frozen=True)
class UnknownFields:
    reject: bool = False  # --reject-unknown-fields

    def check(self, body: BaseModel, rid: str) -> dict[str, str]:
        """The headers the response carries: none when every field is known."""
        found = unknown_fields(body)
        if not found:
            return {}
        # The names are the client's: printable ASCII only, so that they can neither break the
        # header nor forge log lines.
        names = [ascii(name)[1:-1][:MAX_NAME_CHARS] for name in found[:MAX_NAMED]]
        listed = ", ".join(names) + (f" (and {len(found) - MAX_NAMED} more)" if len(found) > MAX_NAMED else "")
        if self.reject:
            raise bad_request(f"unknown fields: {listed} (the server runs with --reject-unknown-fields)", names[0])
        log.warning("request %s: ignored unknown fields: %s", rid, listed)
        return {HEADER: ", ".join(names)}
