"""MegaRing under ``jax.distributed``: one process per device, XLA executor, forward+backward vs float64.

    python -m benchmarks.distributed_check --num-processes 2 --platform cpu      # launcher (this CPU)
    python -m benchmarks.distributed_check --num-processes 8 --platform gpu      # one process per GPU

The launcher (no JAX import) picks a free local port, starts ``--num-processes`` workers of this
module with ``--worker``, sends each one's output to ``<log-dir>/proc<i>.log`` and waits for all of
them with ``--timeout-s`` (on timeout it kills the workers it started and fails).

Each worker: ``jax.distributed.initialize("127.0.0.1:<port>", num_processes, process_id)``; on CPU
with ``JAX_PLATFORMS=cpu``, one CPU device per process and gloo collectives
(``jax_cpu_collectives_implementation="gloo"``); on GPUs with ``CUDA_VISIBLE_DEVICES=<i>``. It builds
the global mesh over every process's devices, plans a sampled packed batch with BuddyRing, builds
its own shards of the CP-layout inputs from host data (identical on every process, same seed) with
``jax.make_array_from_callback``, runs ``megaring_attention`` (XLA executor) forward and backward
under ``jit``, gathers out / dQ / dK / dV and process 0 checks them against the float64 reference
(``multi_gpu_common.PackedCheck``) and writes the report (``--out``, default
``benchmarks/results/latest/distributed_check.json``).
Exit status 0 only if every worker exited 0 and the check passed.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time

from benchmarks import harness as H


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--platform", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--timeout-s", type=float, default=300.0, help="launcher: wall limit for all workers")
    ap.add_argument("--out", default=H.latest("distributed_check.json"), help="the JSON report")
    ap.add_argument("--log-dir", default=None, help="workers' logs (default: <out>_logs/)")
    ap.add_argument("--dataset", default="pilecc")
    ap.add_argument("--tokens", default=None, help="batch token budget (default 1K on CPU, 16K on GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", help="float32 (at 'highest' matmul precision) | bfloat16")
    ap.add_argument("--heads", default=None, help="Hq,Hkv,D (default 4,2,32 on CPU; 32,8,128 on GPU)")
    ap.add_argument("--tile", type=int, default=None, help="default 16 on CPU, 128 on GPU")
    # worker-only
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1; got {a.num_processes}")
    gpu = a.platform == "gpu"
    a.tokens = a.tokens or ("16K" if gpu else "1K")
    a.heads = tuple(int(x) for x in (a.heads or ("32,8,128" if gpu else "4,2,32")).split(","))
    if len(a.heads) != 3:
        raise ValueError(f"--heads must be Hq,Hkv,D; got {a.heads}")
    a.tile = a.tile or (128 if gpu else 16)
    a.log_dir = a.log_dir or os.path.splitext(a.out)[0] + "_logs"
    return a


# ----------------------------------------------------------------------------- launcher

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env(args, i: int) -> dict:
    env = dict(os.environ)
    # One device per process: drop an inherited emulated-device flag (e.g. from tests/conftest.py).
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    # The workers run this module with ``-m``: the repository root is their import root.
    env["PYTHONPATH"] = H.ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if args.platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env["JAX_PLATFORMS"] = "cuda"
        env["CUDA_VISIBLE_DEVICES"] = str(i)
    return env


def launch(args, argv) -> int:
    os.makedirs(args.log_dir, exist_ok=True)
    result = args.out
    if os.path.exists(result):
        os.remove(result)
    coord = f"127.0.0.1:{_free_port()}"
    passthrough = [a for a in argv if a not in ("--worker",)]
    procs, logs = [], []
    t0 = time.perf_counter()
    for i in range(args.num_processes):
        log = open(os.path.join(args.log_dir, f"proc{i}.log"), "w")
        cmd = [sys.executable, "-m", "benchmarks.distributed_check", *passthrough, "--worker",
               "--process-id", str(i), "--coordinator", coord, "--out", args.out]
        # A new session per worker: on timeout we kill exactly the process groups we started.
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_worker_env(args, i),
                                      cwd=H.ROOT, start_new_session=True))
        logs.append(log)
    print(f"launched {args.num_processes} {args.platform} workers (coordinator {coord}), logs in {args.log_dir}",
          flush=True)
    rcs = [None] * len(procs)
    timed_out = False
    while any(rc is None for rc in rcs):
        for i, p in enumerate(procs):
            if rcs[i] is None:
                rcs[i] = p.poll()
        if any(rc not in (None, 0) for rc in rcs):
            # One worker failed: the others would wait in a collective until the timeout.
            time.sleep(5)
            for i, p in enumerate(procs):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                rcs[i] = p.wait()
            break
        if time.perf_counter() - t0 > args.timeout_s:
            timed_out = True
            for i, p in enumerate(procs):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                rcs[i] = p.wait()
            break
        time.sleep(0.2)
    for f in logs:
        f.close()
    wall = time.perf_counter() - t0
    ok = os.path.exists(result) and json.load(open(result)).get("ok") is True
    print(f"workers exit codes {rcs}{' (timed out after %.0f s)' % args.timeout_s if timed_out else ''}; "
          f"wall {wall:.1f} s; check {'OK' if ok else 'FAILED or missing'} ({result})", flush=True)
    if not ok or any(rcs):
        for i in range(len(procs)):
            with open(os.path.join(args.log_dir, f"proc{i}.log")) as f:
                tail = f.read()[-3000:]
            print(f"--- proc{i}.log (tail) ---\n{tail}", flush=True)
    if os.path.exists(result):
        d = json.load(open(result))
        d.update(launcher={"exit_codes": rcs, "timed_out": timed_out, "wall_s": wall})
        d["meta"]["argv"] = list(argv)  # the launcher's command line, not a worker's
        H.write_json(result, d)
    return 0 if ok and not any(rcs) else 1


# ----------------------------------------------------------------------------- worker

def worker(args) -> int:
    t_start = time.perf_counter()
    import jax
    if args.platform == "cpu":
        # The CPU backend needs a cross-process collectives implementation (gloo ships with jaxlib).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes, process_id=args.process_id,
                               initialization_timeout=120)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import liquidcp_jax as lcp
    from benchmarks import multi_gpu_common as C
    from liquidcp_jax.workloads import sample_batch

    me = jax.process_index()

    def log(msg):
        print(f"[proc {me} {time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    N = jax.device_count()
    log(f"{jax.process_count()} processes, {N} global devices ({jax.devices()[0].platform}), local "
        f"{jax.local_devices()}")
    mesh = jax.make_mesh((N,), ("cp",))
    hq, hkv, d = args.heads
    lengths = [int(x) for x in sample_batch(args.dataset, args.tokens, args.seed)]
    plan = lcp.plan_megaring(lengths, mesh, "cp", placement="buddyring", tile_size=args.tile)
    T = sum(lengths)
    rng = np.random.default_rng(args.seed)   # the same host data on every process
    packed = [C.random_array(rng, (T, h, d), args.dtype) for h in (hq, hkv, hkv, hq)]
    src = np.asarray(plan.shard_src)
    cp = [np.concatenate([x, np.zeros((1,) + x.shape[1:], x.dtype)])[src] for x in packed]
    xs = [C.put(x, plan.sharding) for x in cp]     # each process supplies only its own shards
    dplan = C.put_tree(plan, NamedSharding(mesh, P()))

    def fwd_bwd(q, k, v, do, p):
        o, vjp = jax.vjp(lambda q, k, v: lcp.megaring_attention(q, k, v, p, backend="xla"), q, k, v)
        return (o,) + tuple(vjp(do))

    prec = "highest" if args.dtype == "float32" else None
    with jax.default_matmul_precision(prec) if prec else _null():
        f = jax.jit(fwd_bwd)
        t0 = time.perf_counter()
        res = jax.block_until_ready(f(*xs, dplan))
        t_first = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = jax.block_until_ready(f(*xs, dplan))
        t_second = time.perf_counter() - t0
    log(f"forward+backward: first call {t_first:.2f} s, second {t_second * 1e3:.1f} ms; "
        f"output shards on this process {[s.index for s in res[0].addressable_shards]}")
    got = [C.fetch(r) for r in res]               # a collective: every process takes part
    if me == 0:
        unshard = np.asarray(plan.unshard_src)

        def get(name, heads):
            return {"q": packed[0], "k": packed[1], "v": packed[2], "do": packed[3]}[name][:, heads].astype(np.float32)

        check = C.PackedCheck(lengths, get, hq, hkv, np.random.default_rng(args.seed + 1))
        errs = check.errors({"out": got[0][unshard][:, check.hs], "dq": got[1][unshard][:, check.hs],
                             "dk": got[2][unshard][:, check.ks], "dv": got[3][unshard][:, check.ks]})
        pad = np.ones(plan.cp_tokens, bool)
        pad[unshard] = False
        ok = bool(max(errs.values()) < C.TOL[args.dtype] and np.all(got[0][pad] == 0)
                  and all(np.all(np.isfinite(g)) for g in got))
        res_json = {"meta": H.meta("benchmarks.distributed_check", args.argv), "ok": ok, "errors": errs,
                    "threshold": C.TOL[args.dtype], "check": check.what,
                    "processes": jax.process_count(), "global_devices": N,
                    "collectives": "gloo" if args.platform == "cpu" else "nccl",
                    "batch": {"dataset": args.dataset, "tokens": T, "sequences": len(lengths),
                              "group_sizes": sorted({g.size for g in plan.placement.groups})},
                    "shape": {"hq": hq, "hkv": hkv, "head_dim": d, "tile": args.tile, "dtype": args.dtype},
                    "first_call_s": t_first, "second_call_ms": t_second * 1e3}
        H.write_json(args.out, res_json)
        log(f"errors vs float64 ({check.what}): " + " ".join(f"{k}={v:.2e}" for k, v in errs.items())
            + f" (threshold {C.TOL[args.dtype]:g}) -> {'OK' if ok else 'FAILED'}")
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("distributed_check done")
    jax.distributed.shutdown()
    return 0


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    if args.worker:
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
