"""One client's pipelined burst must not hold the event loop: the socket frontend handles a bounded
number of frames per loop turn, and stops reading while the rest wait.

Found while loading the daemon: 2 MiB of small inference frames in one write kept the loop busy
~50 ms per 256 KiB read, so the loop-lag monitor shed half of them (and every other client's
requests) with 503, and /v2/health/live took up to 112 ms. Handled FRAMES_PER_TURN at a time, the
loop's worst lag stayed under 10 ms and nothing was shed. These tests check the mechanism, with a
fake transport, deterministically.
"""

from __future__ import annotations

import asyncio
from typing import Any

from daemon.api.uds import FRAMES_PER_TURN, SocketConnection, SocketFrontend
from tests.protocol.test_socket_framing import FakeTransport, InstantController, frame, gateway, infer


def connection() -> tuple[SocketConnection, FakeTransport]:
    c = SocketConnection(SocketFrontend(gateway({"max_body_bytes": 4096}, InstantController())))
    t = FakeTransport()
    c.connection_made(t)  # type: ignore[arg-type]
    return c, t


async def turns_until(t: FakeTransport, want: int, answers: list[dict[str, Any]]) -> int:
    """Loop turns until `want` answers are out; a fake transport has no events to wait on."""
    turns = 0
    while len(answers) < want and turns < 10_000:
        await asyncio.sleep(0)  # one turn of the loop: what other clients would get between batches
        answers += t.frames()
        turns += 1
    return turns


def test_a_burst_is_handled_a_turn_at_a_time() -> None:
    n = 5 * FRAMES_PER_TURN + 3

    async def main() -> tuple[int, int, bool, int]:
        c, t = connection()
        c.data_received(b"".join(frame(infer(i)) for i in range(n)))
        first = t.frames()
        paused = not t.reading  # the rest waits in the buffer; no more is read meanwhile
        answers = list(first)
        turns = await turns_until(t, n, answers)
        assert [a["id"] for a in answers] == list(range(n)) and t.reading
        return len(first), turns, paused, len(answers)

    first, turns, paused, total = asyncio.run(main())
    assert first == FRAMES_PER_TURN and paused
    assert total == n and turns >= 5  # the loop ran in between


def test_a_burst_then_a_half_close_is_answered_in_full() -> None:
    n = 3 * FRAMES_PER_TURN

    async def main() -> tuple[list[dict[str, Any]], bool]:
        c, t = connection()
        c.data_received(b"".join(frame(infer(i)) for i in range(n)))
        c.eof_received()  # the client is done sending, before the burst is handled
        answers = t.frames()
        await turns_until(t, n, answers)
        return answers, t.closed

    answers, closed = asyncio.run(main())
    assert [a["id"] for a in answers] == list(range(n)) and closed


def test_backpressure_and_turns_together() -> None:
    """A client that stops reading pauses its connection whatever the turn; both must clear."""

    async def main() -> list[dict[str, Any]]:
        c, t = connection()
        c.data_received(b"".join(frame(infer(i)) for i in range(2 * FRAMES_PER_TURN)))
        c.pause_writing()  # its answers pile up: handle no more of its frames
        answers = t.frames()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert t.frames() == [] and not t.reading
        c.resume_writing()
        await turns_until(t, 2 * FRAMES_PER_TURN, answers)
        return answers

    answers = asyncio.run(main())
    assert [a["id"] for a in answers] == list(range(2 * FRAMES_PER_TURN))


