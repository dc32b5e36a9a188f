"""Query ids: what an answer names so that its feedback can find it (applications, personalized
models)."""

from __future__ import annotations

import secrets
import string

ALPHABET = string.ascii_letters + string.digits
LENGTH = 16  # 62 ** 16, ~95 bits: not guessable (feedback moves an application's or a user's weights)


def new_query_id() -> str:
    """A random id of letters and digits. Never one starting with "-": `secrets.token_urlsafe`'s
    did one time in 64, and `escapement feedback --app APP ID` then read the id as an option (the
    shell example of docs/applications.md failed that way in CI)."""
    choice = secrets.choice
    return "".join(choice(ALPHABET) for _ in range(LENGTH))
