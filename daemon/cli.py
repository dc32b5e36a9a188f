"""`escapement serve | infer | feedback | user | models | profile | train-parity | demo | config`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any

import numpy as np

from daemon import __version__
from daemon.errors import ConfigError

DEFAULT_SOCKET = "run/escapement.sock"


def _settings(args: argparse.Namespace) -> Any:
    from daemon.config import load_settings, with_overrides

    s = load_settings(args.config)
    return with_overrides(s, http=args.http, grpc=args.grpc, socket=args.socket, models=args.models,
                          devices=args.device, policy=getattr(args, "policy", None),
                          log_level=getattr(args, "log_level", None))


def cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from daemon import log as daemon_log
    from daemon.server import Daemon

    settings = _settings(args)
    daemon_log.setup(settings.server.log_level)
    daemon = Daemon(settings)
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(daemon.serve())
    except ConfigError as e:
        logging.getLogger("escapement.server").error("cannot start: %s", e)
        return 2
    except OSError as e:
        logging.getLogger("escapement.server").error("cannot start: %s", e)
        return 1
    stuck = daemon.left_behind()
    if stuck:
        # A thread stuck in a driver call or a dead mount would make the interpreter's own exit
        # wait on it or crash in it: end the process here, with the shutdown done and logged.
        logging.getLogger("escapement.server").warning("exiting with %d thread(s) stuck: %s", len(stuck),
                                                       ", ".join(stuck))
        logging.shutdown()
        sys.stdout.flush()
        os._exit(daemon.exit_code)
    return daemon.exit_code


def cmd_demo(args: argparse.Namespace) -> int:
    from daemon import demo
    from daemon import log as daemon_log

    daemon_log.setup("info")
    logging.getLogger("escapement.demo").setLevel(logging.INFO)
    built = demo.build(args.out, force=args.force, only=args.only)
    print(f"demo models in {args.out}: {len(built)} built, {len(demo.MODELS) + 1 - len(built)} already there"
          if not args.only else f"built {built}")
    if args.variants and not args.only:
        from daemon import variants

        out = args.variants_out or variants.default_out(args.out)
        done = variants.build(out, args.variants, force=args.force)
        print(f"{args.variants} variants of one backbone in {out}: {len(done)} built")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from daemon import log as daemon_log
    from daemon.clock import MonotonicClock
    from daemon.errors import ProgramError
    from daemon.repository import scan
    from daemon.runtime.devices import plan_cores, resolve_devices
    from daemon.runtime.executor import make_backend
    from daemon.runtime.profiler import profile_program, write_profile
    from daemon.runtime.program import load_program

    daemon_log.setup("warning")
    settings = _settings(args)
    rt = settings.runtime
    (device,) = resolve_devices([args.on], rt.weight_budget, rt.device_workspace, rt.emucuda)
    plan, rest = plan_cores([device], os.sched_getaffinity(0), settings.runtime.pin_threads)
    if rest is not None:
        os.sched_setaffinity(0, rest)
    result = scan(settings.models.repository, settings.models.default_slo_ms)
    failed = 0
    for spec in result.models:
        if args.only and spec.name not in args.only:
            continue
        try:
            program = load_program(spec)
            backend = make_backend(device, rt.cpu_threads, plan.get(device.name), graphs=rt.cuda_graphs,
                                   hang_timeout_s=rt.hang_timeout_s, emucuda=rt.emucuda)
            entry = profile_program(program, device, backend, MonotonicClock(), args.reps)
        except (ProgramError, RuntimeError) as e:
            print(f"{spec.key}: not profiled: {e}", file=sys.stderr)
            failed += 1
            continue
        stored = write_profile(spec, device.kind, entry)
        sizes = "  ".join(f"b{b}={ms:.3f}" for b, ms in entry["infer_ms"].items())
        print(f"{spec.key:<24} load {entry['load_ms']:.3f} ms  infer p99 ms: {sizes}"
              + ("" if stored else "  (not stored: repository read-only)"))
    return 1 if failed else 0


def cmd_train_parity(args: argparse.Namespace) -> int:
    from daemon.errors import ProgramError
    from daemon.parity import codes, datasets, lifted, trainer
    from daemon.repository import scan
    from daemon.runtime.program import load_program

    settings = _settings(args)
    result = scan(settings.models.repository, settings.models.default_slo_ms)
    versions = [m for m in result.models if m.name == args.model]
    if args.version is not None:
        versions = [m for m in versions if m.version == args.version]
    if not versions:
        why = result.broken.get(args.model, "not in the repository")
        print(f"escapement: model {args.model}: {why}", file=sys.stderr)
        return 2
    spec = max(versions, key=lambda m: m.version)
    try:
        program = load_program(spec)
        data = datasets.load_dataset(spec, args.data)
    except (ProgramError, ValueError, OSError) as e:
        print(f"escapement: {e}", file=sys.stderr)
        return 2

    try:
        config = trainer.TrainConfig(max_epochs=args.epochs, time_limit_s=args.time_limit, seed=args.seed,
                                     norm=args.norm, val_fraction=args.val_fraction, lr=args.lr)
    except ValueError as e:
        print(f"escapement: {e}", file=sys.stderr)
        return 2
    # "auto": ParM's concatenation code for images it can tile (k = 2 or 4), else sum (codes.default_encoder)
    encoder = codes.default_encoder(args.k, spec.inputs[0].sample_shape) if args.encoder == "auto" else args.encoder
    seen = [0]

    def progress(row: dict[str, float]) -> None:
        seen[0] += 1
        if seen[0] % 10 == 1:  # one line per ten validations
            deg = f"  degraded {row['degraded_accuracy']:.4f}" if "degraded_accuracy" in row else ""
            print(f"step {int(row['step']):>6}  epoch {row['epoch']:7.1f}  {row['seconds']:6.1f} s  "
                  f"lr {row['lr']:.1e}  loss {row['loss']:.4f}  val loss {row['val_loss']:.4f}  "
                  f"val reconstruction {row['reconstruction_accuracy']:.4f}{deg}", flush=True)

    try:
        parity, report = trainer.train(spec, program.host_runner, data, args.k, encoder, progress=progress,
                                       config=config)
    except ValueError as e:
        print(f"escapement: {e}", file=sys.stderr)
        return 2
    file = f"parity-k{args.k}.pt2"
    lifted.export(parity, spec, spec.path.parent / file)
    trainer.set_parity_section(spec.path.parent.parent / "config.toml",
                               trainer.parity_section(args.k, encoder, file, report))
    avail = f"{report.available_accuracy:.4f}" if report.available_accuracy is not None else "-"
    deg = f"{report.degraded_accuracy:.4f}" if report.degraded_accuracy is not None else "-"
    overall = "  ".join(f"f={f:g}: {v:.4f}" for f in trainer.FREQUENCIES
                        if (v := report.overall_accuracy(f)) is not None)
    print(f"stopped after {report.steps} steps ({report.stopped}, {report.seconds:.1f} s); checkpoint of step "
          f"{report.best_step} (epoch {report.best_epoch}) chosen on validation (reconstruction "
          f"{report.val_reconstruction_accuracy:.4f})")
    print(f"{spec.key}: parity model k={args.k} ({encoder}) written to {spec.path.parent / file}; held-out "
          f"test: reconstruction {report.reconstruction_accuracy:.4f}, degraded-mode {deg} "
          f"(available {avail}); [parity] set in config.toml")
    if overall:
        print(f"overall accuracy at unavailability f: {overall}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from daemon.config import describe

    s = _settings(args)
    for key, _default, doc in describe():
        value: Any = s
        for part in key.split("."):
            value = getattr(value, part)
        print(f"{key} = {json.dumps(list(value) if isinstance(value, tuple) else value)}  # {doc}")
    return 0


def _client(args: argparse.Namespace) -> Any:
    from daemon.client import HttpClient, SocketClient

    if args.http:
        return HttpClient(args.http)
    return SocketClient(args.socket or DEFAULT_SOCKET)


def _digits_inputs(meta: dict[str, Any], n: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    from daemon.parity.datasets import digits_split

    _, _, x, y = digits_split()
    shape = meta["inputs"][0]["shape"][1:]
    if int(np.prod(shape)) != 64:
        raise SystemExit(f"--digits needs a model taking 64 values per sample, not {shape}")
    return {meta["inputs"][0]["name"]: x[:n].reshape(n, *shape).astype(np.float32)}, y[:n]


def _random_inputs(meta: dict[str, Any], n: int) -> dict[str, np.ndarray]:
    from daemon.datatypes import BY_NAME

    rng = np.random.default_rng(0)
    out = {}
    for t in meta["inputs"]:
        dt = BY_NAME[t["datatype"]].numpy
        shape = (n, *t["shape"][1:])
        out[t["name"]] = (rng.standard_normal(shape) if dt.kind == "f" else rng.integers(0, 2, shape)).astype(dt)
    return out


def cmd_infer(args: argparse.Namespace) -> int:
    from daemon.client import HttpClient, InferenceServerError

    labels = None
    with _client(args) as c:
        try:
            if args.input:
                inputs = {}
                for item in args.input:
                    name, _, path = item.partition("=")
                    if not path:
                        raise SystemExit(f"--input wants NAME=FILE.npy, got {item!r}")
                    inputs[name] = np.load(path)
            else:
                model, version = args.model, args.version
                if args.app:  # an application: its inputs are its first model's
                    model, version = c.app_status(args.model)["models"][0], None
                path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
                meta = c.get_json(path) if isinstance(c, HttpClient) else c.metadata(model, version)
                if args.digits:
                    inputs, labels = _digits_inputs(meta, args.digits)
                else:
                    inputs = _random_inputs(meta, args.batch)
            timeout = int(args.timeout_ms * 1000) if args.timeout_ms is not None else None
            if args.app:  # docs/applications.md
                return _print_app_answer(c.app_infer(args.model, inputs, timeout_us=timeout), labels, args.json)
            user = {"user": args.user} if args.user else {}  # a personalized model's user (docs/personalization.md)
            r = c.infer(args.model, inputs, version=args.version, timeout_us=timeout, **user)
        except InferenceServerError as e:
            print(f"error {e.status}: {e.message}", file=sys.stderr)
            return 1
        except (ConnectionError, FileNotFoundError, OSError) as e:
            print(f"cannot reach the daemon: {e}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"model": r.model, "version": r.version, "reconstructed": r.reconstructed,
                          **({"query_id": r.query_id} if r.query_id else {}),
                          "outputs": {k: v.tolist() for k, v in r.outputs.items()}}))
        return 0
    print(f"model {r.model} version {r.version}" + (" (reconstructed)" if r.reconstructed else ""))
    if r.query_id:
        print(f"query_id: {r.query_id}  (escapement feedback {r.model} {r.query_id} LABEL)")
    for name, arr in r.outputs.items():
        print(f"{name}: shape {list(arr.shape)} {arr.dtype}")
        if arr.ndim == 2:
            pred = arr.argmax(axis=1)
            print(f"  argmax: {pred.tolist()}")
            if labels is not None:
                print(f"  labels: {labels.tolist()}  ({int((pred == labels).sum())}/{len(labels)} correct)")
        with np.printoptions(precision=4, suppress=True, threshold=40):
            print("  " + str(arr).replace("\n", "\n  "))
    return 0


def _print_app_answer(r: Any, labels: Any, as_json: bool) -> int:
    """An application's answer (docs/applications.md)."""
    if as_json:
        print(json.dumps({"app": r.app, "models": r.models, "query_id": r.query_id, "skipped": r.skipped,
                          "late": r.late, "default": r.default, "partial": r.partial,
                          "outputs": {k: v.tolist() for k, v in r.outputs.items()}}))
        return 0
    flags = [f for f, on in (("default", r.default), ("partial", r.partial)) if on]
    print(f"application {r.app}: answered by {', '.join(r.models) or 'no model'}"
          + (f" ({', '.join(flags)})" if flags else "") + (f"; skipped {', '.join(r.skipped)}" if r.skipped else ""))
    if r.query_id:
        print(f"query_id: {r.query_id}  (escapement feedback --app {r.app} {r.query_id} LABEL)")
    for name, arr in r.outputs.items():
        pred = arr.reshape(len(arr), -1).argmax(axis=1)
        print(f"{name}: shape {list(arr.shape)} {arr.dtype}\n  argmax: {pred.tolist()}")
        if labels is not None:
            print(f"  labels: {labels.tolist()}  ({int((pred == labels).sum())}/{len(labels)} correct)")
    return 0


def cmd_feedback(args: argparse.Namespace) -> int:
    """The true label of a personalized answer: updates that user's weights (docs/personalization.md);
    with --app, an application's query: its policy learns (docs/applications.md)."""
    from daemon.client import InferenceServerError

    try:
        with _client(args) as c:
            if args.cmd == "feedback" and args.app:
                if (args.label is None) == (args.reward is None):
                    print("give the query's true LABEL or --reward R, one of them", file=sys.stderr)
                    return 2
                label_a: Any = None if args.label is None else (
                    [int(v) for v in args.label.split(",")] if "," in args.label else int(args.label))
                answer = c.app_feedback(args.model, args.query_id, label=label_a, reward=args.reward)
            elif args.cmd == "feedback":
                if args.label is None:
                    print("give the query's true LABEL", file=sys.stderr)
                    return 2
                label: Any = [int(v) for v in args.label.split(",")] if "," in args.label else int(args.label)
                answer = c.feedback(args.model, args.query_id, label, version=args.version)
            else:
                answer = c.user(args.model, args.user, version=args.version)
    except ValueError:
        print(f"LABEL must be an integer (or integers separated by commas), got {args.label!r}", file=sys.stderr)
        return 2
    except InferenceServerError as e:
        print(f"error {e.status}: {e.message}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"cannot reach the daemon: {e}", file=sys.stderr)
        return 1
    print(json.dumps(answer))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from daemon.client import InferenceServerError

    try:
        with _client(args) as c:
            index = c.index()
    except (InferenceServerError, OSError) as e:
        print(f"cannot list models: {e}", file=sys.stderr)
        return 1
    for m in index:
        reason = f"  ({m['reason']})" if m.get("reason") else ""
        print(f"{m['name']:<24} {m.get('version', '-'):>4}  {m['state']}{reason}")
    return 0


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (default: the embedded config/escapement.toml)")
    p.add_argument("--http", metavar="HOST:PORT", help="HTTP listener; '' disables it")
    p.add_argument("--grpc", metavar="HOST:PORT", help="gRPC (KServe v2) listener; '' disables it")
    p.add_argument("--socket", metavar="PATH", help="unix socket path; '' disables it")
    p.add_argument("--models", metavar="DIR", help="model repository")
    p.add_argument("--device", action="append", metavar="NAME",
                   help="device (repeat, or comma-separate): auto, cpu:0, cuda:0, ...")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="escapement", description=__doc__)
    ap.add_argument("--version", action="version", version=f"escapement {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="run the daemon in the foreground")
    _add_server_flags(p)
    p.add_argument("--policy", help="scheduling policy (controller.policy)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("config", help="print the effective settings with their documentation")
    _add_server_flags(p)
    p.set_defaults(fn=cmd_config)

    p = sub.add_parser("profile", help="measure each model's LOAD and INFER times and store them (profile.json)")
    _add_server_flags(p)
    p.add_argument("--on", default="cpu:0", metavar="DEVICE", help="the device to measure on (default cpu:0)")
    p.add_argument("--reps", type=int, default=20, help="runs per batch size (default 20)")
    p.add_argument("--only", action="append", help="profile only this model (repeatable)")
    p.set_defaults(fn=cmd_profile)

    p = sub.add_parser("train-parity", help="train a ParM parity model for a repository model")
    _add_server_flags(p)
    p.add_argument("model")
    p.add_argument("--k", type=int, default=2, help="data batches per coding group (default 2)")
    p.add_argument("--encoder", choices=["auto", "sum", "concat"], default="auto",
                   help="the code: auto picks concat for images it can tile at k = 2 or 4, else sum")
    p.add_argument("--data", metavar="FILE.npz", help="inputs: x [and y] (split 80/20) or x_train/x_test "
                   "[y_train/y_test]; default: the demo digits")
    p.add_argument("--epochs", type=int, help="at most this many epochs (default: a step budget scaled to the "
                   "data; training stops earlier on a validation plateau)")
    p.add_argument("--time-limit", type=float, default=240.0, metavar="S",
                   help="stop training after S seconds, keeping the best checkpoint (default 240)")
    p.add_argument("--seed", type=int, default=0, help="seeds the validation split, weights and groups (default 0)")
    p.add_argument("--norm", choices=["recalibrate", "batch", "frozen"], default="recalibrate",
                   help="BatchNorm: batch statistics of parity inputs while training, running statistics "
                   "recalibrated on parity inputs (default), kept as momentum averages (batch), or frozen (old)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's initial learning rate (default 1e-3)")
    p.add_argument("--val-fraction", type=float, default=0.2,
                   help="share of the training data held out to choose the checkpoint (default 0.2)")
    p.add_argument("--version", type=int, help="the model version (default: the newest)")
    p.set_defaults(fn=cmd_train_parity)

    p = sub.add_parser("demo", help="build the demo model repository (offline)")
    p.add_argument("--out", default="models", help="repository directory (default: models)")
    p.add_argument("--force", action="store_true", help="rebuild models that are already there")
    p.add_argument("--only", action="append", help="build only this model (repeatable)")
    p.add_argument("--variants", type=int, default=4, metavar="N",
                   help="fine-tuned variants of one digits backbone to build (default 4; 0: none)")
    p.add_argument("--variants-out", metavar="DIR",
                   help="their model repository (default: OUT-variants beside --out)")
    p.set_defaults(fn=cmd_demo)

    for name, fn, text in (("infer", cmd_infer, "run one inference"), ("models", cmd_models, "list models")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--socket", help=f"unix socket of the daemon (default: {DEFAULT_SOCKET})")
        p.add_argument("--http", metavar="HOST:PORT", help="use HTTP instead of the socket")
        if name == "infer":
            p.add_argument("model")
            p.add_argument("--version")
            p.add_argument("--input", action="append", metavar="NAME=FILE.npy", help="an input from a .npy file")
            p.add_argument("--digits", type=int, metavar="N", help="send N held-out digits (digits models)")
            p.add_argument("--batch", type=int, default=1, help="batch of random inputs (default 1)")
            p.add_argument("--timeout-ms", type=float, help="deadline for this request")
            p.add_argument("--json", action="store_true", help="print the result as JSON")
            p.add_argument("--user", help="a personalized model's user: adds its output and a query_id")
            p.add_argument("--app", action="store_true", help="MODEL names an application (docs/applications.md)")
        p.set_defaults(fn=fn)
    for name, text in (("feedback", "give a personalized answer's true label (updates its user's weights)"),
                       ("user", "a personalized model's user: updates so far, the last one's time")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--socket", help=f"unix socket of the daemon (default: {DEFAULT_SOCKET})")
        p.add_argument("--http", metavar="HOST:PORT", help="use HTTP instead of the socket")
        p.add_argument("--version", help="the model version (default: the query's, or the newest)")
        p.add_argument("model")
        if name == "feedback":
            p.add_argument("query_id", help="the query_id of the answer")
            p.add_argument("label", nargs="?", help="its true class (a batch: one per sample, comma-separated)")
            p.add_argument("--app", action="store_true",
                           help="MODEL names an application: its policy learns (docs/applications.md)")
            p.add_argument("--reward", type=float, help="with --app: a reward in [0, 1] instead of the label")
        else:
            p.add_argument("user")
        p.set_defaults(fn=cmd_feedback)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except ConfigError as e:
        print(f"escapement: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
