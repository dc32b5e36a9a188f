"""Seeded generators of malformed input for the daemon's two frontends (the `soak` scenario).

Each case is what one client connection sends: one or more requests (HTTP) or frames (socket),
the writes they are cut into, and how the connection ends. Case `i` of a frontend depends only on
(seed, frontend, i), so any case can be rebuilt on its own to reproduce a finding:
`python -m bench.fuzzgen http --seed 0 --index 1234` prints its bytes.

Most inputs are a valid-looking request with exactly one thing wrong, so the parser goes past
the first check and into the deep ones (a fuzzer of pure noise only ever tests the first byte);
some are left valid (both sides of every check are reached), and a few are pure random bytes.
Every request carries what the generator knows of it: whether its framing is intact (the daemon
must read exactly this request), whether the daemon must close after it, whether it asked for
a deadline (a 504 is then a fair answer) or for a feature the daemon does not offer (a 501).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

import msgpack

Finish = Literal["half_close", "read", "reset"]
LENGTH = struct.Struct(">I")

# Datatypes a request may name: the real ones, and near misses.
DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32",
             "FP64", "BF16", "BYTES"]
BAD_DATATYPES = ["fp32", "Fp32", "FP8", "", " FP32", "FP32\x00", "FLOAT", "TYPE_FP32", "FP3", "FP32 "]
PACK = {"FP32": "f", "FP64": "d", "FP16": "e", "INT32": "i", "INT64": "q", "INT16": "h", "INT8": "b", "UINT8": "B",
        "UINT16": "H", "UINT32": "I", "UINT64": "Q", "BOOL": "?"}
# JSON values of every type, for "put something else there".
JUNK: list[Any] = [None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 0.5, 1e39, -1e308, "", "x",
                   "FP32", "1", [], [1], [[1, 2]], {}, {"a": 1}, [None], ["a"], "\u00e9\u4e2d", "\ud7ff"]


# msgpack holds integers in [-2**63, 2**64 - 1] only
MSGPACK_JUNK: list[Any] = [x for x in JUNK if not isinstance(x, int) or -(2**63) <= x < 2**64]


@dataclass(frozen=True)
class ModelInfo:
    """What the generator needs to know of a model to write valid requests for it."""

    name: str
    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, datatype, shape of one sample)
    outputs: tuple[str, ...]
    max_batch: int
    weight: float = 1.0  # how often it is chosen

    def values(self, i: int, batch: int) -> int:
        n = batch
        for d in self.inputs[i][2]:
            n *= d
        return n


@dataclass
class Request:
    """One HTTP request (or a random blob standing for one) and what the daemon owes it."""

    raw: bytes
    method: str
    kind: str
    framed: bool = True  # the daemon must read exactly this request from these bytes
    ends: bool | None = False  # it closes after this one: True, False, or None (may or may not)
    mistake: bool = True  # not a pristine request
    asks_deadline: bool = False  # parameters.timeout was given: a 504 is a fair answer
    feature: bool = False  # asks for something not offered (shared memory, classification): a 501 is fair


@dataclass
class Frame:
    """One socket frame (or bytes standing for one) and what the daemon owes it."""

    raw: bytes
    kind: str
    rid: int | None  # the id it carries, when it is ours and valid (its answer must echo it)
    intact: bool = True  # its length prefix is right: exactly one answer
    closes: bool = False  # the daemon must answer (413) and close the connection after it
    mistake: bool = True
    asks_deadline: bool = False


@dataclass
class Case:
    frontend: Literal["http", "socket"]
    index: int
    items: list[Any]  # Request or Frame
    chunks: list[bytes] = field(default_factory=list)  # the writes
    finish: Finish = "half_close"
    pause: bool = False  # sleep 1 ms between writes so each reaches the daemon on its own

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def kinds(self) -> list[str]:
        return [i.kind for i in self.items]


def rng_for(seed: int, frontend: str, index: int) -> random.Random:
    # random.Random seeds a str through SHA-512: the same case on every machine and Python run
    return random.Random(f"{seed}:{frontend}:{index}")


def _split(rng: random.Random, parts: list[bytes]) -> list[bytes]:
    """The writes: all at once, one per request, or cut at random byte boundaries."""
    data = b"".join(parts)
    r = rng.random()
    if r < 0.45 or len(data) < 2:
        return [data]
    if r < 0.7:
        return [p for p in parts if p]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 12))))
    if rng.random() < 0.3:  # the first bytes one at a time: a request line that trickles in
        cuts = sorted(set(cuts) | set(range(1, min(len(data), rng.randint(2, 8)))))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


def _pick_model(rng: random.Random, models: list[ModelInfo]) -> ModelInfo:
    return rng.choices(models, weights=[m.weight for m in models])[0]


_POOL_SIZE = 16384  # more values than the largest demo input (3x32x32 x 4 samples)


@cache
def _pool(seed: int) -> list[float]:
    """Values to slice tensors from: drawing each float per request cost ~0.4 ms of a 1 ms budget."""
    r = random.Random(f"{seed}:values")
    return [round(r.uniform(-2.0, 2.0), 3) for _ in range(_POOL_SIZE)]


def _floats(rng: random.Random, n: int) -> list[float]:
    pool = _pool(0)
    if n >= len(pool):
        return (pool * (n // len(pool) + 1))[:n]
    start = rng.randrange(len(pool) - n + 1)
    return pool[start : start + n]


def _nest(flat: list[Any], shape: list[int]) -> Any:
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _pack_values(dt: str, vals: list[float]) -> bytes:
    """`vals` as the binary tensor data of `dt` (KServe v2: little-endian; BYTES: each element a
    4-byte length and its bytes; BF16: the high half of each FP32)."""
    if dt == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in (str(v).encode() for v in vals))
    if dt == "BF16":
        f32 = struct.pack(f"<{len(vals)}f", *vals)
        return b"".join(f32[i + 2 : i + 4] for i in range(0, len(f32), 4))
    code = PACK.get(dt, "f")
    if code in "fde":
        return struct.pack(f"<{len(vals)}{code}", *vals)
    if code == "?":
        return struct.pack(f"<{len(vals)}?", *(v > 0 for v in vals))
    return struct.pack(f"<{len(vals)}{code}", *(abs(int(v)) if code.isupper() else int(v) for v in vals))


def _json_values(dt: str, vals: list[float]) -> list[Any]:
    """`vals` as the JSON data of `dt`: numbers of its kind, booleans, or strings for BYTES."""
    if dt == "BYTES":
        return [str(v) for v in vals]
    if dt == "BOOL":
        return [v > 0 for v in vals]
    if dt.startswith(("INT", "UINT")):
        return [abs(int(v)) if dt.startswith("U") else int(v) for v in vals]
    return vals


# ===================================================================== HTTP


class HttpGen:
    """Generates HTTP cases against a daemon serving `models` with the given body limit."""

    def __init__(self, models: list[ModelInfo], seed: int = 0, max_body: int = 1 << 20, port: int = 0) -> None:
        self.models = models
        self.seed = seed
        self.max_body = max_body
        self.port = port

    def case(self, index: int) -> Case:
        rng = rng_for(self.seed, "http", index)
        n = rng.choice([1, 1, 1, 1, 2, 2, 3, 4, 6])  # several requests per write: pipelining
        reqs = [self.request(rng) for _ in range(n)]
        case = Case("http", index, reqs, _split(rng, [r.raw for r in reqs]))
        r = rng.random()
        sure = all(q.framed and q.ends is False for q in reqs)
        case.finish = "reset" if r < 0.08 else "read" if r < 0.25 and sure else "half_close"
        case.pause = len(case.chunks) > 1 and rng.random() < 0.05
        return case

    def request(self, rng: random.Random) -> Request:
        r = rng.random()
        if r < 0.04:
            return self._random(rng)
        pristine = r < 0.22
        if rng.random() < 0.68:
            return self._infer(rng, None if pristine else rng.choice(INFER_LAYERS))
        return self._other(rng, pristine)

    # ------------------------------------------------------------ building blocks

    def _serialize(self, method: str, target: str, headers: list[tuple[str, str | None]], body: bytes,
                   version: str = "HTTP/1.1") -> bytes:
        """A value of None writes the name as a whole raw line (a malformed header line)."""
        lines = "".join(f"{k}\r\n" if v is None else f"{k}: {v}\r\n" for k, v in headers)
        head = f"{method} {target} {version}\r\n" + lines + "\r\n"
        return head.encode("utf-8", "surrogateescape") + body

    def _random(self, rng: random.Random) -> Request:
        kind = rng.choice(["bytes", "printable", "line"])
        if kind == "bytes":
            raw = rng.randbytes(rng.randint(1, 600))
        elif kind == "printable":
            raw = "".join(rng.choice("GETPOST /:\r\n\t HTTP1.0abc%{}\"[]") for _ in range(rng.randint(1, 300))).encode()
        else:
            raw = b"POST /v2/models/x/infer HTTP/1.1\r\n" + rng.randbytes(rng.randint(1, 200))
        return Request(raw, "?", f"random:{kind}", framed=False, ends=None)

    def _base_headers(self, rng: random.Random, body: bytes) -> list[tuple[str, str | None]]:
        h = [("Host", rng.choice(["127.0.0.1", "localhost", f"127.0.0.1:{self.port}", "x"]))]
        if body or rng.random() < 0.3:
            h.append(("Content-Length", str(len(body))))
        if rng.random() < 0.2:
            h.append(("Content-Type", "application/json"))
        if rng.random() < 0.1:
            h.append(("User-Agent", "soak/1"))
        return h

    def _infer_body(self, rng: random.Random, m: ModelInfo, binary: bool) -> tuple[dict[str, Any], list[bytes]]:
        batch = rng.randint(1, min(4, m.max_batch)) if m.values(0, 1) < 2000 else 1
        inputs, chunks = [], []
        for i, (name, dt, _) in enumerate(m.inputs):
            vals = _floats(rng, m.values(i, batch))
            shape = [batch, *m.inputs[i][2]]
            t: dict[str, Any] = {"name": name, "datatype": dt, "shape": shape}
            if binary:
                b = _pack_values(dt, vals)
                t["parameters"] = {"binary_data_size": len(b)}
                chunks.append(b)
            else:
                t["data"] = _nest(vals, shape) if rng.random() < 0.3 else vals
            inputs.append(t)
        obj: dict[str, Any] = {"inputs": inputs}
        if rng.random() < 0.3:
            obj["id"] = "".join(rng.choice("abcdef0123456789-") for _ in range(rng.randint(0, 40)))
        if rng.random() < 0.2:
            obj["parameters"] = {"binary_data_output": rng.random() < 0.5}
        if rng.random() < 0.1:
            obj["outputs"] = [{"name": o} for o in m.outputs]
        return obj, chunks

    def _infer(self, rng: random.Random, layer: str | None) -> Request:
        m = _pick_model(rng, self.models)
        binary = rng.random() < 0.4
        obj, chunks = self._infer_body(rng, m, binary)
        path = f"/v2/models/{m.name}/infer" if rng.random() < 0.85 else f"/v2/models/{m.name}/versions/1/infer"
        req = Request(b"", "POST", "infer:valid", mistake=layer is not None)
        mutate_obj = layer == "json"
        doc: Any = obj
        if mutate_obj:
            label, doc = _mutate_obj(rng, obj, chunks, m, req)
            req.kind = "infer:json:" + label
        header = json.dumps(doc).encode()
        body = header + b"".join(chunks)
        extra: list[tuple[str, str | None]] = [(HEADER_LEN, str(len(header)))] if chunks else []
        if layer == "text":
            body, extra, label = _mutate_text(rng, header, chunks)
            req.kind = "infer:text:" + label
        headers = self._base_headers(rng, body) + extra
        method, version = "POST", "HTTP/1.1"
        if layer == "header":
            body, headers, label = self._mutate_headers(rng, body, headers, req)
            req.kind = "infer:header:" + label
        elif layer == "line":
            method, path, version, label = self._mutate_line(rng, method, path, version, req)
            req.kind = "infer:line:" + label
        req.method = method
        req.raw = self._serialize(method, path, headers, body, version)
        return req

    def _other(self, rng: random.Random, pristine: bool) -> Request:
        """Everything but inference: health, metadata, statistics, metrics, repository, management."""
        m = _pick_model(rng, self.models)
        method, path, body = rng.choice([
            ("GET", "/v2/health/live", b""), ("GET", "/v2/health/ready", b""), ("GET", "/v2", b""),
            ("GET", f"/v2/models/{m.name}", b""), ("GET", f"/v2/models/{m.name}/ready", b""),
            ("GET", f"/v2/models/{m.name}/config", b""), ("GET", f"/v2/models/{m.name}/stats", b""),
            ("GET", f"/v2/models/{m.name}/versions/1", b""), ("GET", "/v2/models/stats", b""),
            ("GET", "/metrics", b""), ("GET", "/v2/controller/stats", b""), ("POST", "/v2/repository/index", b"{}"),
            ("POST", "/v2/repository/index", b'{"ready": true}'), ("HEAD", "/v2/health/live", b""),
            # management: refused (403) unless the token or loopback opening allows it; never allowed here
            ("GET", "/v2/admin/faults", b""), ("POST", "/v2/admin/faults", b'{"device": "cpu:0", "hang": true}'),
            ("POST", f"/v2/repository/models/{m.name}/unload", b"{}"), ("DELETE", "/v2/admin/faults/cpu:0", b""),
            ("POST", "/v2/repository/r/index", b""),
        ])
        req = Request(b"", method, "other:valid", mistake=not pristine)
        headers = self._base_headers(rng, body)
        version = "HTTP/1.1"
        if not pristine:
            layer = rng.choice(["header", "header", "line", "line", "body"])
            if layer == "header":
                body, headers, label = self._mutate_headers(rng, body, headers, req)
            elif layer == "line":
                method, path, version, label = self._mutate_line(rng, method, path, version, req)
            else:
                body = rng.choice([b"[", b"\xff\xfe", b'{"ready": "yes"}', b'{"parameters": 5}', b"null",
                                   b'{"parameters": {"unload_dependents": 1}}', b'{"parameters": {"config": "{}"}}',
                                   rng.randbytes(64)])
                headers = [h for h in headers if h[0] != "Content-Length"] + [("Content-Length", str(len(body)))]
                label = "body"
            req.kind = f"other:{layer}:{label}"
        req.method = method
        req.raw = self._serialize(method, path, headers, body, version)
        return req

    # ------------------------------------------------------------ mutations below the body

    def _mutate_line(self, rng: random.Random, method: str, path: str, version: str,
                     req: Request) -> tuple[str, str, str, str]:
        what = rng.choice(["method", "method", "path", "path", "path", "path", "version"])
        if what == "method":
            good = ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "POST"]
            bad = ["get", "FOO", "G ET", "", "POST\t", "PO\x00ST", "X" * rng.randint(20, 300), "CONNECT", "PRI",
                   "M-SEARCH", "SOURCE"]
            if rng.random() < 0.6:
                method = rng.choice(good)
                return method, path, version, f"method:{method}"
            method = rng.choice(bad)
            req.framed, req.ends = False, None
            if method == "CONNECT":
                path = rng.choice(["127.0.0.1:80", "[::1]:443", "x", path])
            return method, path, version, "method:bad"
        if what == "version":
            v = rng.choice(["HTTP/1.0", "HTTP/1.0", "HTTP/2.0", "HTTP/9.9", "http/1.1", "HTTP/1.1x", "", "HTTP/1",
                            "HTTP/0.9"])
            if v == "HTTP/1.0":
                req.ends = True  # no keep-alive asked for: answered, then closed
            else:
                req.framed, req.ends = False, None
            return method, path, v, f"version:{v or 'none'}"
        # the path: encodings, lengths, absolute forms
        m = _pick_model(rng, self.models)
        choices: list[tuple[str, Callable[[], str]]] = [
            ("slash_encoded", lambda: path.replace(f"/models/{m.name}", f"/models/{m.name[:2]}%2F{m.name[2:]}")),
            ("encoded_name", lambda: path.replace(m.name, "".join(f"%{ord(c):02X}" for c in m.name))),
            ("double_encoded", lambda: path.replace("/models/", "/models/%252F")),
            ("bad_percent", lambda: path + rng.choice(["%", "%z", "%zz", "%ff%fe", "%00", "%C0%AF"])),
            ("long", lambda: "/v2/models/" + "a" * rng.choice([300, 4000, 20000, 60000]) + "/infer"),
            ("too_long", lambda: "/v2/models/" + "a" * 70000 + "/infer"),
            ("absolute", lambda: rng.choice(["http://127.0.0.1", f"http://127.0.0.1:{self.port}",
                                             "http://evil.example", "https://x"]) + path),
            ("absolute_bad", lambda: rng.choice(["http://", "http://[::1", "http://[::1]:x/", "//", "http:/x",
                                                 "*", "http://a@b@c/", "?"])),
            ("dots", lambda: path.replace("/v2/", rng.choice(["/v2/./", "/v2/../v2/", "/x/../v2/", "/v2//"]))),
            ("query", lambda: path + rng.choice(["?", "?a=b", "?a=%zz", "?" + "q" * 5000, "#frag", "?a#b"])),
            ("trailing", lambda: path + rng.choice(["/", "//", "/x", ";x", "%20"])),
            ("version_path", lambda: f"/v2/models/{m.name}/versions/"
                                     + rng.choice(["0", "2", "99999999999999999999999", "-1", "1.0", "x", ""])
                                     + "/infer"),
            ("unknown", lambda: rng.choice(["/", "/v1/models/x", "/v2/models", "/v2/models/", "/v3", "/metrics/x",
                                            "/v2/models/nope/infer", "/v2/health", "/v2/repository/models//load"])),
            ("raw_bytes", lambda: path + rng.choice(["/\u00e9", "/\u4e2d", " x", "\t", "/\udcff"])),
        ]
        label, make = rng.choice(choices)
        new = make()
        if label in ("too_long",):
            req.ends = True  # 431, then closed
        elif label in ("absolute_bad", "raw_bytes", "bad_percent"):
            req.framed, req.ends = label != "raw_bytes", None
        return method, new, version, f"path:{label}"

    def _mutate_headers(self, rng: random.Random, body: bytes, headers: list[tuple[str, str | None]],
                        req: Request) -> tuple[bytes, list[tuple[str, str | None]], str]:
        without_cl = [h for h in headers if h[0].lower() != "content-length"]
        n = len(body)
        what = rng.choice(["cl", "cl", "cl", "te", "te", "ce", "ce", "ce", "host", "origin", "ctype", "expect",
                           "connection", "huge", "many", "bad", "auth", "dup_host", "header_len"])
        label = what
        if what == "cl":
            v = rng.choice(["missing", "dup_same", "dup_diff", "over_limit", "huge", "negative", "alpha", "smaller",
                            "larger", "spaces", "plus", "hex", "empty", "comma"])
            label = f"cl:{v}"
            cl: list[tuple[str, str | None]] = {
                "missing": [],
                "dup_same": [("Content-Length", str(n)), ("Content-Length", str(n))],
                "dup_diff": [("Content-Length", str(n)), ("Content-Length", str(n + 1))],
                "over_limit": [("Content-Length", str(self.max_body + rng.randint(1, 10**6)))],
                "huge": [("Content-Length", rng.choice([str(2**63), str(2**64 + 5), "9" * 40]))],
                "negative": [("Content-Length", "-" + str(n))],
                "alpha": [("Content-Length", "abc")],
                "smaller": [("Content-Length", str(max(0, n - rng.randint(1, 10))))],
                "larger": [("Content-Length", str(n + rng.randint(1, 100)))],
                "spaces": [("Content-Length", f"  {n}  ")],
                "plus": [("Content-Length", f"+{n}")],
                "hex": [("Content-Length", hex(n))],
                "empty": [("Content-Length", "")],
                "comma": [("Content-Length", f"{n}, {n}")],
            }[v]
            # How llhttp reads most of these is its business: only two are certain.
            req.framed, req.ends = False, None
            if v == "over_limit":
                req.framed, req.ends = True, True  # 413 before the body is read, then closed
            elif v == "missing" and n == 0:
                req.framed, req.ends = True, False
            return body, without_cl + cl, label
        if what == "te":
            v = rng.choice(["ok", "ok_ext", "ok_trailer", "bad_size", "overflow", "negative", "no_crlf", "short",
                            "no_last", "te_and_cl", "te_gzip", "te_dup"])
            label = f"te:{v}"
            pieces = _chunk_pieces(rng, body)
            te = [("Transfer-Encoding", "chunked")]
            enc = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
            last = b"0\r\n\r\n"
            req.framed, req.ends = v.startswith("ok"), False if v.startswith("ok") else None
            if v == "ok_ext":
                enc = b"".join(b"%x;name=val\r\n%s\r\n" % (len(p), p) for p in pieces)
            elif v == "ok_trailer":
                last = b"0\r\nX-Trailer: 1\r\n\r\n"
            elif v == "bad_size":
                enc = b"zz\r\n" + enc
            elif v == "overflow":
                enc = b"f" * rng.randint(17, 40) + b"\r\nab\r\n" + enc
            elif v == "negative":
                enc = b"-5\r\nabcde\r\n" + enc
            elif v == "no_crlf":
                enc = enc.replace(b"\r\n", b"\n", 1) if enc else b"5abcde"
            elif v == "short":
                enc = b"%x\r\n%s\r\n" % (len(body) + 3, body)
            elif v == "no_last":
                last = b""
            elif v == "te_and_cl":
                te = [*te, ("Content-Length", str(len(enc) + len(last)))]
            elif v == "te_gzip":
                te = [("Transfer-Encoding", "gzip, chunked")]
            elif v == "te_dup":
                te = [*te, ("Transfer-Encoding", "chunked")]
            return enc + last, without_cl + te, label
        if what == "ce":
            v = rng.choice(["gzip", "deflate", "raw_deflate", "bomb", "bomb_big", "corrupt", "truncated", "trailing",
                            "unknown", "double", "empty", "not_compressed", "upper", "empty_blocks"])
            label = f"ce:{v}"
            enc_name = "gzip"
            req.ends = None
            if v == "gzip":
                data, req.ends = gzip.compress(body, mtime=0), False
            elif v == "deflate":
                data, enc_name, req.ends = zlib.compress(body), "deflate", False
            elif v == "raw_deflate":
                c = zlib.compressobj(wbits=-15)
                data, enc_name, req.ends = c.compress(body) + c.flush(), "deflate", False
            elif v == "bomb":
                enc_name = rng.choice(["gzip", "deflate"])
                data, req.ends = _bomb(enc_name, self.max_body + 1), True
            elif v == "bomb_big":
                enc_name = rng.choice(["gzip", "deflate"])
                data, req.ends = _bomb(enc_name, 64 * 2**20), True
            elif v == "corrupt":
                z = bytearray(gzip.compress(body, mtime=0))
                for _ in range(rng.randint(1, 4)):
                    z[rng.randrange(len(z))] ^= 1 << rng.randrange(8)
                data = bytes(z)
            elif v == "truncated":
                z = gzip.compress(body, mtime=0)
                data, req.ends = z[: rng.randrange(len(z))], True
            elif v == "trailing":
                data, req.ends = gzip.compress(body, mtime=0) + b"garbage", True
            elif v == "unknown":
                enc_name = rng.choice(["br", "compress", "zstd", "gzip, gzip", "identity, gzip", "x"])
                data, req.ends = body, True
            elif v == "double":
                data = gzip.compress(gzip.compress(body, mtime=0), mtime=0)
                req.ends = False  # decoded once: the body is gzip bytes, not JSON: a 400, not a refusal
            elif v == "empty":
                data, req.ends = b"", None
            elif v == "not_compressed":
                data, enc_name = body, rng.choice(["gzip", "deflate"])
            elif v == "upper":
                data, enc_name, req.ends = gzip.compress(body, mtime=0), "GZIP", False
            else:  # a deflate stream of empty stored blocks: grows nothing, never ends on its own
                data, enc_name, req.ends = b"\x78\x9c" + b"\x00\x00\x00\xff\xff" * 20000, "deflate", None
            return data, [*without_cl, ("Content-Length", str(len(data))), ("Content-Encoding", enc_name)], label
        if what == "host":
            v = rng.choice(["", "evil.example", "127.0.0.1:1", "localhost:" + str(self.port), "[::1]", "a" * 5000,
                            "127.0.0.1 x", "\u00e9"])
            return body, [h for h in headers if h[0] != "Host"] + ([("Host", v)] if rng.random() < 0.8 else []), \
                "host"
        if what == "dup_host":
            return body, [*headers, ("Host", "other.example")], "dup_host"
        if what == "origin":
            v = rng.choice(["http://evil.example", "null", f"http://127.0.0.1:{self.port}", "http://localhost", ""])
            return body, [*headers, ("Origin", v)], "origin"
        if what == "ctype":
            v = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                            "application/json; charset=latin-1", "", "application/octet-stream", ";;;"])
            return body, [h for h in headers if h[0] != "Content-Type"] + [("Content-Type", v)], "ctype"
        if what == "auth":
            v = rng.choice(["Bearer ", "Bearer x", "Basic eDp5", "Bearer " + "t" * 3000, ""])
            return body, [*headers, ("Authorization", v)], "auth"
        if what == "expect":
            v = rng.choice(["100-continue", "100-Continue", "200-ok", ""])
            return body, [*headers, ("Expect", v)], f"expect:{v or 'empty'}"
        if what == "connection":
            v = rng.choice(["close", "keep-alive", "upgrade", "Upgrade, close", "x"])
            if v in ("close", "Upgrade, close"):
                req.ends = True
            extra = [("Connection", v)]
            if "pgrade" in v:
                extra.append(("Upgrade", rng.choice(["websocket", "h2c"])))
                req.ends = None  # llhttp hands the rest to another protocol: answered or not, then closed
            return body, headers + extra, f"connection:{v}"
        if what == "huge":
            req.ends = True  # 431, then closed
            return body, [*headers, ("X-Big", "v" * rng.choice([66000, 100000]))], "huge_header"
        if what == "many":
            req.ends = True
            return body, headers + [(f"X-H{i}", "v") for i in range(rng.choice([130, 500]))], "many_headers"
        if what == "header_len":
            v = rng.choice(["0", "-1", "abc", " 7 ", "1e3", str(2**70), str(n + 1), str(n), "", "12, 12"])
            hs = [h for h in headers if h[0] != HEADER_LEN] + [(HEADER_LEN, v)]
            if rng.random() < 0.2:
                hs = [h for h in headers if h[0] != HEADER_LEN]
            return body, hs, "header_len"
        # "bad": malformed header lines
        v = rng.choice(["X Bad: 1", "NoColon", " folded: 1", "X-Nul: a\x00b", "X-Ctl: a\x01b", ": empty", "X-\u00e9: 1",
                        "X-Tab:\tv", "X-Lf: a\nb"])
        req.framed = v == "X-Tab:\tv"
        req.ends = False if req.framed else None
        return body, [*headers, (v, None)], "bad_header"


HEADER_LEN = "Inference-Header-Content-Length"
INFER_LAYERS = ["json", "json", "json", "json", "text", "text", "header", "header", "line"]


def _chunk_pieces(rng: random.Random, body: bytes) -> list[bytes]:
    if not body:
        return []
    cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(0, 4)))) if len(body) > 1 else []
    return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]


@cache
def _bomb(encoding: str, size: int) -> bytes:
    """`size` zero bytes compressed: a few KiB that expand past the body limit."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31 if encoding == "gzip" else 15)
    block = b"\0" * 2**20
    parts = [c.compress(block) for _ in range(size // len(block))]
    parts.append(c.compress(b"\0" * (size % len(block))))
    return b"".join(parts) + c.flush()


# ------------------------------------------------------------ mutations of the body's JSON


def _mutate_obj(rng: random.Random, obj: dict[str, Any], chunks: list[bytes], m: ModelInfo,
                req: Request) -> tuple[str, Any]:
    """One change to a valid request object; returns its label and what to send (the object, or what
    replaces it)."""
    t = obj["inputs"][0]
    what = rng.choice(["datatype", "recoded", "recoded", "shape", "shape", "data_len", "data_nan", "data_huge",
                       "data_type", "data_nested", "data_missing", "binary_size", "binary_flag", "inputs", "outputs",
                       "id", "id", "params", "params", "top", "name"])
    if what == "datatype":
        t["datatype"] = rng.choice(BAD_DATATYPES + DATATYPES + [None, 5, ["FP32"]])
    elif what == "recoded":  # another datatype, its data written consistently: each decoder, then the model's check
        dt = t["datatype"] = rng.choice(DATATYPES)
        n = m.values(0, t["shape"][0])
        if "data" in t:
            t["data"] = _json_values(dt, _floats(rng, n))
        elif chunks:
            chunks[0] = _pack_values(dt, _floats(rng, n))
            t["parameters"]["binary_data_size"] = len(chunks[0])
        what = f"recoded:{dt}"
    elif what == "shape":
        s = list(t["shape"])
        v = rng.choice(["drop", "add", "dim", "zero", "over", "negative", "big", "float", "str", "bool", "junk",
                        "missing", "empty"])
        if v == "drop" and len(s) > 1:
            s.pop(rng.randrange(len(s)))
        elif v == "add":
            s.insert(rng.randrange(len(s) + 1), rng.choice([1, 2]))
        elif v == "dim":
            i = rng.randrange(len(s))
            s[i] = s[i] + rng.choice([-1, 1])
        elif v == "zero":
            s[0] = 0
        elif v == "over":
            s[0] = m.max_batch + rng.choice([1, 100])
        elif v == "negative":
            s[rng.randrange(len(s))] = rng.choice([-1, -(2**31)])
        elif v == "big":
            s[rng.randrange(len(s))] = rng.choice([2**31, 2**32 + 1, 2**63 - 1, 2**64, 10**30])
        elif v == "float":
            s[0] = float(s[0])
        elif v == "str":
            s[0] = str(s[0])
        elif v == "bool":
            s[0] = True
        if v == "junk":
            t["shape"] = rng.choice(JUNK)
        elif v == "missing":
            del t["shape"]
        elif v == "empty":
            t["shape"] = []
        else:
            t["shape"] = s
        what = f"shape:{v}"
    elif what.startswith("data_") and "data" not in t:
        # a binary tensor: break its bytes instead
        if chunks:
            chunks[0] = chunks[0][: -rng.randint(1, 4)] if rng.random() < 0.5 else chunks[0] + b"\0" * rng.randint(1, 4)
            t["parameters"]["binary_data_size"] = len(chunks[0]) if rng.random() < 0.5 else \
                t["parameters"]["binary_data_size"]
        what = "binary_bytes"
    elif what == "data_len":
        flat = _flat(t["data"])
        if rng.random() < 0.5 and flat:
            flat.pop()
        else:
            flat.append(0.5)
        t["data"] = flat
    elif what == "data_nan":
        flat = _flat(t["data"])
        flat[rng.randrange(len(flat))] = rng.choice([float("nan"), float("inf"), float("-inf")])
        t["data"] = flat
    elif what == "data_huge":
        flat = _flat(t["data"])
        flat[rng.randrange(len(flat))] = rng.choice([1e39, -1e39, 1.7e308, 2**70, -(2**64), 2**63, 10**30, 3e38,
                                                     5e-324, -0.0])
        t["data"] = flat
    elif what == "data_type":
        flat = _flat(t["data"])
        flat[rng.randrange(len(flat))] = rng.choice(["1.0", True, None, {}, [], [1.0], "nan"])
        t["data"] = flat
    elif what == "data_nested":
        flat = _flat(t["data"])
        v = rng.choice(["ragged", "deeper", "wrapped", "rows"])
        if v == "ragged":
            t["data"] = [flat[:1], flat[1:]]
        elif v == "deeper":
            t["data"] = [[[x]] for x in flat]
        elif v == "wrapped":
            t["data"] = [flat]
        else:
            t["data"] = [flat[i : i + 3] for i in range(0, len(flat), 3)]
        what = f"data_nested:{v}"
    elif what == "data_missing":
        v = rng.choice(["delete", "null", "str", "dict", "number", "empty"])
        if v == "delete":
            del t["data"]
        else:
            t["data"] = {"null": None, "str": "abc", "dict": {"a": 1}, "number": 5, "empty": []}[v]
    elif what == "binary_size":
        p = t.setdefault("parameters", {})
        p["binary_data_size"] = rng.choice([-1, 0, 1, 2**63, 2**64, "12", 1.5, None, True, [4]] +
                                           [p.get("binary_data_size", 4) + d for d in (-1, 1)])
        if "data" in t and rng.random() < 0.5:
            del t["data"]
    elif what == "binary_flag":
        p = t.setdefault("parameters", {})
        v = rng.choice(["shm", "binary_data", "params_junk"])
        if v == "shm":
            p["shared_memory_region"] = "r"
            p["shared_memory_byte_size"] = 16
            req.feature = True
        elif v == "binary_data":
            p["binary_data"] = rng.choice([True, "yes", 1])
        else:
            t["parameters"] = rng.choice(JUNK)
        what = f"binary_flag:{v}"
    elif what == "inputs":
        v = rng.choice(["empty", "junk", "extra", "duplicate", "entry_junk", "name_missing"])
        if v == "empty":
            obj["inputs"] = []
        elif v == "junk":
            obj["inputs"] = rng.choice(JUNK)
        elif v == "extra":
            obj["inputs"].append({"name": "EXTRA", "datatype": "FP32", "shape": [1], "data": [1.0]})
        elif v == "duplicate":
            obj["inputs"].append(dict(t))
        elif v == "entry_junk":
            obj["inputs"][0] = rng.choice(JUNK)
        else:
            del t["name"]
        what = f"inputs:{v}"
    elif what == "name":
        t["name"] = rng.choice(["", "input__0", "OUTPUT__0", "INPUT__0 ", "\u00e9", None, 7, "a" * 1000])
    elif what == "outputs":
        v = rng.choice(["unknown", "duplicate", "classification", "binary_junk", "junk", "entry_junk", "empty"])
        outs = [{"name": o} for o in m.outputs]
        if v == "unknown":
            outs.append({"name": "nope"})
        elif v == "duplicate":
            outs = outs + outs
        elif v == "classification":
            outs[0]["parameters"] = {"classification": rng.choice([1, 3])}
            req.feature = True
        elif v == "binary_junk":
            outs[0]["parameters"] = {"binary_data": rng.choice(JUNK)}
        elif v == "entry_junk":
            outs = [rng.choice(JUNK)]
        elif v == "empty":
            outs = []
        obj["outputs"] = rng.choice(JUNK) if v == "junk" else outs
        what = f"outputs:{v}"
    elif what == "id":
        v = rng.choice([0, 1, 16, 255, 256, 257, 1024, 70000, "multibyte", "junk"])
        if v == "multibyte":
            obj["id"] = "\u4e2d" * rng.choice([50, 86, 90, 200])  # 3 bytes a character: over 256 bytes at 86
        elif v == "junk":
            obj["id"] = rng.choice(JUNK)
        else:
            obj["id"] = "i" * int(v)
        what = f"id:{v}"
    elif what == "params":
        p: dict[str, Any] = {}
        v = rng.choice(["timeout", "timeout", "priority", "binary_output", "junk", "unknown"])
        if v == "timeout":
            p["timeout"] = rng.choice([-1, 0, 1, 10, 100, 1000, 10**6, 10**12, 2**63, "100", 1.5, None, True])
            req.asks_deadline = True
        elif v == "priority":
            p["priority"] = rng.choice([-1, 0, 1, 5, 2**31, 2**64, "1", 1.5, None])
        elif v == "binary_output":
            p["binary_data_output"] = rng.choice(JUNK)
        elif v == "unknown":
            p["sequence_id"] = 5
        obj["parameters"] = rng.choice(JUNK) if v == "junk" else p
        what = f"params:{v}"
    else:  # top
        v = rng.choice(["list", "scalar", "missing_inputs", "extra_key"])
        if v == "list":
            return "top:list", [obj]
        if v == "scalar":
            return "top:scalar", rng.choice(JUNK)
        if v == "missing_inputs":
            del obj["inputs"]
        else:
            obj["unexpected"] = {"x": [1, 2]}
        what = f"top:{v}"
    return what, obj


def _flat(data: Any) -> list[Any]:
    out: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, list):
            for y in x:
                walk(y)
        else:
            out.append(x)

    walk(data)
    return out


def _mutate_text(rng: random.Random, header: bytes,
                 chunks: list[bytes]) -> tuple[bytes, list[tuple[str, str | None]], str]:
    """A change to the body's bytes; the Content-Length is computed afterwards, so framing stays intact."""
    tail = b"".join(chunks)
    v = rng.choice(["truncate", "utf8", "bom", "trailing", "deep", "deep_object", "big_number", "empty", "nul",
                    "header_len", "header_len_missing", "raw_binary", "tail_short", "tail_long", "nan_literal",
                    "single_quote"])
    if v == "truncate":
        header = header[: rng.randrange(max(1, len(header)))]
    elif v == "utf8":
        at = rng.randrange(len(header) + 1)
        bad = rng.choice([b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"])
        header = header[:at] + bad + header[at:]
    elif v == "bom":
        header = b"\xef\xbb\xbf" + header
    elif v == "trailing":
        header = header + rng.choice([b"x", b" ", b"{}", b"\x00", b",", b"]"])
    elif v == "deep":
        d = rng.choice([100, 1000, 1025, 100000])
        header = b'{"inputs": [{"name": "INPUT__0", "datatype": "FP32", "shape": [1, 4], "data": ' + \
            b"[" * d + b"1" + b"]" * d + b"}]}"
    elif v == "deep_object":
        d = rng.choice([500, 1025, 50000])
        header = b'{"a":' * d + b"1" + b"}" * d
    elif v == "big_number":
        header = header.replace(b"[", b"[" + b"9" * rng.choice([20, 400, 5000]) + b",", 1)
    elif v == "empty":
        header = b""
    elif v == "nul":
        header = header.replace(b'"', b'"\x00', 1)
    elif v == "nan_literal":
        word = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"nan", b"1e400"])
        header = header.replace(b"[", b"[" + word + b",", 1)
    elif v == "single_quote":
        header = header.replace(b'"', b"'")
    elif v in ("header_len", "header_len_missing", "tail_short", "tail_long"):
        if v == "tail_short" and tail:
            tail = tail[: -rng.randint(1, min(4, len(tail)))]
        elif v == "tail_long":
            tail = tail + rng.randbytes(rng.randint(1, 8))
        body = header + tail
        if v == "header_len_missing":
            return body, [], v
        hl = rng.choice(["0", "-1", "abc", " 7 ", "1e3", str(2**70), str(len(header) - 1), str(len(header) + 1),
                         str(len(body)), str(len(body) + 1), "", f"{len(header)}, {len(header)}"])
        return body, [(HEADER_LEN, hl)], v
    elif v == "raw_binary":  # Inference-Header-Content-Length: 0: the body is the one input's bytes, batch 1
        return tail or rng.randbytes(rng.choice([4, 256, 3136])), [(HEADER_LEN, "0")], v
    # only the JSON text is wrong: a binary request's header length follows it
    return header + tail, [(HEADER_LEN, str(len(header)))] if tail else [], v


# ===================================================================== socket


class SocketGen:
    """Generates socket cases: msgpack frames, each with a unique id unless the id is the mutation."""

    def __init__(self, models: list[ModelInfo], seed: int = 0, max_frame: int = 1 << 20) -> None:
        self.models = models
        self.seed = seed
        self.max_frame = max_frame

    def case(self, index: int) -> Case:
        rng = rng_for(self.seed, "socket", index)
        n = rng.choice([1, 1, 1, 2, 2, 3, 4, 6, 8])
        frames = [self.frame(rng, index * 100 + i) for i in range(n)]
        case = Case("socket", index, frames, _split(rng, [f.raw for f in frames]))
        r = rng.random()
        sure = all(f.intact and not f.closes for f in frames)
        case.finish = "reset" if r < 0.08 else "read" if r < 0.15 and sure else "half_close"
        case.pause = len(case.chunks) > 1 and rng.random() < 0.05
        return case

    def frame(self, rng: random.Random, rid: int) -> Frame:
        r = rng.random()
        if r < 0.04:  # pure random bytes, length prefix and all
            raw = rng.randbytes(rng.randint(1, 300))
            return Frame(raw, "random", None, intact=False, closes=False)
        pristine = r < 0.22
        msg = self._message(rng, rid)
        f = Frame(b"", "valid", rid, mistake=not pristine)
        if not pristine:
            layer = rng.choice(["map", "map", "map", "map", "payload", "frame"])
            if layer == "map":
                f.kind = "map:" + self._mutate_map(rng, msg, f)
            elif layer == "payload":
                payload, f.kind = self._mutate_payload(rng, msg)
                f.raw = LENGTH.pack(len(payload)) + payload
                f.rid = None  # not a map the daemon can read: its answer cannot carry the id
                return f
            else:
                payload = msgpack.packb(msg, use_bin_type=True)
                return self._mutate_frame(rng, payload, f)
        if "timeout_us" in msg:
            f.asks_deadline = True
        payload = msgpack.packb(msg, use_bin_type=True)
        f.raw = LENGTH.pack(len(payload)) + payload
        return f

    def _message(self, rng: random.Random, rid: int) -> dict[str, Any]:
        if rng.random() < 0.15:
            m = _pick_model(rng, self.models)
            op = rng.choice(["live", "ready", "index", "stats", "metadata", "model_ready", "config"])
            msg: dict[str, Any] = {"op": op, "id": rid}
            if op in ("metadata", "model_ready", "config"):
                msg["model"] = m.name
            return msg
        m = _pick_model(rng, self.models)
        batch = rng.randint(1, min(4, m.max_batch)) if m.values(0, 1) < 2000 else 1
        inputs = [{"name": name, "datatype": dt, "shape": [batch, *shape],
                   "data": _pack_values(dt, _floats(rng, m.values(i, batch)))}
                  for i, (name, dt, shape) in enumerate(m.inputs)]
        msg = {"id": rid, "model": m.name, "inputs": inputs}
        if rng.random() < 0.5:
            msg["op"] = "infer"
        if rng.random() < 0.1:
            msg["outputs"] = list(m.outputs)
        if rng.random() < 0.1:
            msg["version"] = rng.choice(["1", 1])
        if rng.random() < 0.05:
            msg["priority"] = rng.choice([0, 10, 20])
        return msg

    def _mutate_map(self, rng: random.Random, msg: dict[str, Any], f: Frame) -> str:
        inputs = msg.get("inputs")
        what = rng.choice(["op", "model", "version", "id", "id", "inputs", "shape", "shape", "datatype", "data",
                           "data", "outputs", "timeout", "priority", "keys", "extra"])
        if what in ("shape", "datatype", "data") and not inputs:
            what = "op"
        if what == "op":
            msg["op"] = rng.choice(["nope", "", "INFER", "Live", None, 1, b"infer", ["infer"], "infer\x00"])
        elif what == "model":
            v = rng.choice(["missing", "unknown", "int", "bytes", "long", "empty", "slash"])
            if v == "missing":
                msg.pop("model", None)
            else:
                msg["model"] = {"unknown": "nope", "int": 5, "bytes": b"digits_mlp", "long": "m" * 5000, "empty": "",
                                "slash": "digits/mlp"}[v]
            what = f"model:{v}"
        elif what == "version":
            msg["version"] = rng.choice(["2", "0", "-1", "x", "", 2, -1, 2**64 - 1, True, 1.0, None, [1], b"1"])
        elif what == "id":
            v = rng.choice(["long", "limit", "bytes", "float", "bool", "list", "dict", "neg", "big", "none", "str"])
            f.rid = None
            msg["id"] = {"long": "i" * rng.choice([257, 1000, 70000]), "limit": "i" * 256, "bytes": b"id",
                         "float": 1.5, "bool": True, "list": [1], "dict": {"a": 1}, "neg": -5, "big": 2**64 - 1,
                         "none": None, "str": "s" * rng.randint(0, 40)}[v]
            what = f"id:{v}"
        elif what == "inputs":
            v = rng.choice(["empty", "junk", "entry_junk", "extra", "duplicate", "missing"])
            if v == "missing":
                msg.pop("inputs", None)
            elif v == "extra" and inputs:
                inputs.append({"name": "EXTRA", "datatype": "FP32", "shape": [1], "data": b"\0" * 4})
            elif v == "duplicate" and inputs:
                inputs.append(dict(inputs[0]))
            elif v == "entry_junk" and inputs:
                inputs[0] = rng.choice([*MSGPACK_JUNK, b"x"])
            else:
                msg["inputs"] = [] if v == "empty" else rng.choice(MSGPACK_JUNK)
            what = f"inputs:{v}"
        elif what == "shape":
            t = inputs[0]  # type: ignore[index]
            s = list(t["shape"])
            v = rng.choice(["dim", "zero", "over", "negative", "big", "huge", "float", "junk", "missing", "rank"])
            if v == "dim":
                s[-1] += rng.choice([-1, 1])
            elif v == "zero":
                s[0] = 0
            elif v == "over":
                s[0] = 33
            elif v == "negative":
                s[0] = -1
            elif v == "big":
                s[-1] = rng.choice([2**31, 2**32, 2**63 - 1])
            elif v == "huge":
                s[-1] = 2**64 - 1
            elif v == "float":
                s[0] = 1.0
            elif v == "rank":
                s.append(1)
            if v == "junk":
                t["shape"] = rng.choice([*MSGPACK_JUNK, b"\x01"])
            elif v == "missing":
                del t["shape"]
            else:
                t["shape"] = s
            what = f"shape:{v}"
        elif what == "datatype":
            t = inputs[0]  # type: ignore[index]
            if rng.random() < 0.5:  # another datatype, its data written consistently
                t["datatype"] = rng.choice(DATATYPES)
                t["data"] = _pack_values(t["datatype"], _floats(rng, len(t["data"]) // 4))
                what = f"recoded:{t['datatype']}"
            else:
                t["datatype"] = rng.choice(BAD_DATATYPES + DATATYPES + [None, 5, b"FP32"])
        elif what == "data":
            t = inputs[0]  # type: ignore[index]
            v = rng.choice(["short", "long", "empty", "str", "list", "none", "int", "missing", "ext"])
            d = t["data"]
            t["data"] = {"short": d[: -rng.randint(1, 4)], "long": d + b"\0" * rng.randint(1, 4), "empty": b"",
                         "str": "abc", "list": [1.0, 2.0], "none": None, "int": 5,
                         "ext": msgpack.ExtType(5, d[:8])}.get(v, d)
            if v == "missing":
                del t["data"]
            elif v == "ext":
                f.rid = None  # extension types are refused while the map is read: no id to echo
            what = f"data:{v}"
        elif what == "outputs":
            msg["outputs"] = rng.choice([["nope"], ["OUTPUT__0", "OUTPUT__0"], "OUTPUT__0", [1], [None], [], {},
                                         [b"OUTPUT__0"]])
        elif what == "timeout":
            msg["timeout_us"] = rng.choice([-1, 0, 1, 10, 1000, 10**5, 10**12, 2**64 - 1, "100", 1.5, None, True])
            f.asks_deadline = True
        elif what == "priority":
            msg["priority"] = rng.choice([-1, 0, 1, 2**31, 2**64 - 1, "1", 1.5, None, True])
        elif what == "keys":  # keys msgpack allows and JSON does not
            msg[rng.choice([1, b"model", None, 1.5, True])] = "x"  # type: ignore[index]
            f.rid = None  # the daemon reads only str keys: the map, id and all, is refused unread
        else:
            msg["unexpected"] = rng.choice(MSGPACK_JUNK)
        return what

    def _mutate_payload(self, rng: random.Random, msg: dict[str, Any]) -> tuple[bytes, str]:
        """Bytes inside an intact frame that are not one well-formed map."""
        packed = msgpack.packb(msg, use_bin_type=True)
        v = rng.choice(["truncated", "trailing", "not_map", "random", "empty", "str_data", "deep", "map32",
                        "array32", "bin32", "flip", "ext", "timestamp", "nil"])
        if v == "truncated":
            return packed[: rng.randrange(len(packed))], v
        if v == "trailing":
            return packed + rng.choice([b"\xc0", b"\x01\x02", packed]), v
        if v == "not_map":
            return msgpack.packb(rng.choice([[msg], 5, "infer", b"x", 1.5, True, [1, 2, 3]]), use_bin_type=True), v
        if v == "random":
            return rng.randbytes(rng.randint(1, 200)), v
        if v == "empty":
            return b"", v
        if v == "str_data":
            return msgpack.packb(msg, use_bin_type=False), v  # data as str: invalid UTF-8 raw bytes
        if v == "deep":
            d = rng.choice([100, 2000, 100000])
            return b"\x91" * d + b"\xc0", v
        if v == "map32":
            return b"\xdf\xff\xff\xff\xff" + packed[1:], v
        if v == "array32":
            return b"\x81\xa6inputs\xdd\xff\xff\xff\xf0" + b"\xc0" * 8, v
        if v == "bin32":
            return b"\x81\xa4data\xc6\xff\xff\xff\xf0" + b"\0" * 16, v
        if v == "flip":
            b = bytearray(packed)
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            return bytes(b), v
        if v == "ext":
            return msgpack.packb({**msg, "id": msgpack.ExtType(1, b"x")}, use_bin_type=True), v
        if v == "timestamp":
            return b"\x81\xa2id\xd6\xff\x00\x00\x00\x01", v
        return b"\xc0", v

    def _mutate_frame(self, rng: random.Random, payload: bytes, f: Frame) -> Frame:
        """The length prefix itself is wrong."""
        v = rng.choice(["shorter", "longer", "oversized", "max", "zero_then", "split_prefix"])
        f.kind = f"frame:{v}"
        if v == "shorter":
            f.raw, f.intact = LENGTH.pack(max(0, len(payload) - rng.randint(1, 8))) + payload, False
        elif v == "longer":
            f.raw, f.intact = LENGTH.pack(len(payload) + rng.randint(1, 1000)) + payload, False
        elif v == "oversized":
            f.raw, f.intact, f.closes = LENGTH.pack(self.max_frame + rng.randint(1, 10**6)) + payload[:16], False, True
        elif v == "max":
            f.raw, f.intact, f.closes = LENGTH.pack(2**32 - 1) + payload[:16], False, True
        elif v == "zero_then":  # an empty frame (a 400), then the real one
            f.raw = LENGTH.pack(0) + LENGTH.pack(len(payload)) + payload
            f.kind, f.rid = "frame:zero_then", None  # two answers: counted by the checker as not intact
            f.intact = False
        else:  # only part of the prefix, then nothing more: the connection ends inside a frame
            f.raw, f.intact = LENGTH.pack(len(payload))[: rng.randint(1, 3)], False
        return f


def main(argv: list[str] | None = None) -> int:
    """Print one case (to reproduce a finding), or time the generator."""
    ap = argparse.ArgumentParser(prog="python -m bench.fuzzgen")
    ap.add_argument("frontend", choices=["http", "socket"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--port", type=int, default=0, help="the port the soak's HTTP cases named (its Host header)")
    ap.add_argument("--max-body", type=int, default=1 << 20)
    args = ap.parse_args(argv)
    from bench.scenarios.soak import fuzz_models  # the models the soak fuzzes

    models = fuzz_models()
    gen: HttpGen | SocketGen = HttpGen(models, args.seed, args.max_body, args.port) if args.frontend == "http" \
        else SocketGen(models, args.seed, args.max_body)
    case = gen.case(args.index)
    print(json.dumps({"frontend": case.frontend, "index": case.index, "kinds": case.kinds, "finish": case.finish,
                      "writes": [c.hex() for c in case.chunks]}, indent=1))
    print(repr(case.data[:4000]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
