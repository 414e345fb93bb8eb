"""Tensor parallelism inside one machine: tuichat starts its own worker processes (no torchrun).

Each rank holds a slice of every decoder layer: q/k/v and gate/up are split by output rows (whole heads),
o_proj and down_proj by input columns, followed by one all-reduce each (Megatron's scheme, as nano-vllm's
linear layers do). Embeddings and lm_head stay replicated: for chat-sized models they are a small share of a
step, and replicating them avoids a gather. The KV cache is split by KV heads, since each rank only ever
computes attention for its own heads.

Rank 0 is the engine: it schedules, broadcasts each step's plan, runs its own shard and samples. Workers
loop on plans. Transport: NCCL for activations on CUDA, gloo on CPU; plans always go over gloo.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from tuichat.engine.families import ModelShape
from tuichat.engine.fusion import linear
from tuichat.engine.kv_cache import KVCache
from tuichat.engine.runner import ModelRunner, RunnerBroken, StepChunk
from tuichat.engine.types import TuichatError

_COLUMN = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
_ROW = {"self_attn": "o_proj", "mlp": "down_proj"}
_STARTUP_TIMEOUT_S = 300
COLLECTIVE_TIMEOUT_S = 120
DEATH_GRACE_S = 1.0  # how long a failed step waits for a dying worker to be seen dead (see execute)


class RowParallelLinear(nn.Module):
    """A linear whose input features are split over ranks; partial sums are all-reduced."""

    def __init__(self, linear: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        cols = linear.in_features // world
        self.weight = nn.Parameter(linear.weight.data[:, rank * cols : (rank + 1) * cols].contiguous(), False)
        # The bias is added once, by rank 0, before the sum.
        bias = linear.bias.data if (linear.bias is not None and rank == 0) else None
        self.bias = None if bias is None else nn.Parameter(bias.clone(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        if y.device.type == "cpu" and y.dtype != torch.float32:
            # gloo sums 16-bit floats slowly or not at all; the sum in float32 is also more exact.
            total = y.float()
            dist.all_reduce(total)
            return total.to(y.dtype)
        dist.all_reduce(y)
        return y


def _column_split(linear: nn.Linear, rank: int, world: int) -> None:
    rows = linear.out_features // world
    linear.weight = nn.Parameter(linear.weight.data[rank * rows : (rank + 1) * rows].contiguous(), False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[rank * rows : (rank + 1) * rows].contiguous(), False)
    linear.out_features = rows


def check_shardable(config, world: int) -> None:
    shape = ModelShape.of(config)
    if shape.heads % world or shape.kv_heads % world or shape.intermediate % world:
        raise TuichatError(
            f"--tp {world} does not divide this model: {shape.heads} attention heads, {shape.kv_heads} KV heads, "
            f"MLP width {shape.intermediate}. Pick a TP size that divides all three."
        )


def shard_model(model, rank: int, world: int) -> None:
    """Cut `model` in place down to rank's slice."""
    check_shardable(model.config, world)
    for layer in model.model.layers:
        for part_name, names in _COLUMN.items():
            part = getattr(layer, part_name)
            if not all(hasattr(part, n) for n in names):
                raise TuichatError(
                    f"{type(model).__name__} has fused or unusual projections; tensor parallelism supports "
                    "models with separate q/k/v and gate/up projections (Llama, Qwen2/3, Mistral, Gemma)."
                )
            for name in names:
                _column_split(getattr(part, name), rank, world)
            setattr(part, _ROW[part_name], RowParallelLinear(getattr(part, _ROW[part_name]), rank, world))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to rebuild its shard: everything picklable."""

    resolved: object  # types.ResolvedModel
    device: str  # "cpu" or "cuda" (rank r uses cuda:r)
    dtype: str
    world: int
    init_method: str
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    num_layers: int


def _rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device.startswith("cuda") else torch.device("cpu")


def init_rank(spec: WorkerSpec, rank: int) -> dist.ProcessGroup:
    backend = "nccl" if spec.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # The activations' all-reduces come a layer apart, so a peer silent for minutes is hung: time out. Workers
    # wait for plans as long as the app stays idle, so the plan group never does.
    dist.init_process_group(
        backend, init_method=spec.init_method, rank=rank, world_size=spec.world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    return dist.new_group(backend="gloo", timeout=timedelta(days=7))


def _worker_main(spec: WorkerSpec, rank: int, ready) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    try:
        from tuichat.engine import attention, loader

        plan_group = init_rank(spec, rank)
        device = _rank_device(spec.device, rank)
        model, _ = loader.load(spec.resolved, device, getattr(torch, spec.dtype), with_tokenizer=False)
        shard_model(model, rank, spec.world)
        model.set_attn_implementation(attention.register())
        kv = KVCache(spec.num_layers, spec.num_blocks, spec.block_size, spec.kv_heads // spec.world,
                     spec.head_dim, model.dtype, [device] * spec.num_layers)
        runner = ModelRunner(model, kv, spec.block_size, device)
    except BaseException as exc:  # tell rank 0 why instead of leaving it waiting
        ready.send(f"{type(exc).__name__}: {exc}")
        raise
    ready.send("ready")
    while True:
        box: list = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=plan_group)
        except Exception:  # rank 0 is gone: exit rather than linger as an orphan
            return
        if box[0] is None:
            break
        try:
            runner.execute(box[0])
        except Exception as exc:  # the ranks are out of step now: say why, and leave (rank 0 sees the exit)
            ready.send(f"{type(exc).__name__}: {exc}")
            os._exit(1)
    dist.destroy_process_group()


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: broadcast the plan, then run the same forward as every worker.

    A failure on any rank mid-step leaves the others inside a collective that will never be matched, so no
    later step can be trusted: the runner stops every worker and raises RunnerBroken, which ends the requests
    and tells the user to load the model again (LocalBackend then starts fresh workers)."""

    def __init__(self, model, kv: KVCache, block_size: int, device: torch.device, workers, plan_group, pipes) -> None:
        super().__init__(model, kv, block_size, device)
        self.workers = workers
        self.plan_group = plan_group
        self.pipes = pipes  # per worker: where it says why it failed
        self.broken: str | None = None

    def _dead_worker(self) -> str | None:
        for rank, (proc, pipe) in enumerate(zip(self.workers, self.pipes), start=1):
            said = None
            try:
                if pipe.poll():
                    said = pipe.recv()
            except (EOFError, OSError):  # the worker is gone and said nothing
                pass
            if said is not None or not proc.is_alive():
                proc.join(timeout=5)
                why = f": {said}" if said else ""
                return f"tensor-parallel worker {rank} died (exit code {proc.exitcode}){why}"
        return None

    def execute(self, chunks: list[StepChunk]):
        if self.broken is not None:
            raise RunnerBroken(self.broken)
        try:
            if (dead := self._dead_worker()) is not None:
                raise RuntimeError(dead)
            dist.broadcast_object_list([chunks], src=0, group=self.plan_group)
            return super().execute(chunks)
        except Exception as exc:
            # A killed worker's sockets close while it exits, a moment before it can be seen to have: give it that
            # moment, so that the error names the worker rather than the broken connection it left.
            mp.connection.wait([proc.sentinel for proc in self.workers], timeout=DEATH_GRACE_S)
            why = self._dead_worker() or f"tensor-parallel rank 0 failed mid-step: {type(exc).__name__}: {exc}"
            self.broken = f"{why}. Its workers were stopped; load the model again to restart them."
            self._stop_workers()
            raise RunnerBroken(self.broken) from exc

    def _stop_workers(self) -> None:
        for proc in self.workers:
            if proc.is_alive():
                proc.kill()  # it may be blocked in a collective that will never complete
        for proc in self.workers:
            proc.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self) -> None:
        if self.broken is None and all(p.is_alive() for p in self.workers):
            try:
                dist.broadcast_object_list([None], src=0, group=self.plan_group)
            except Exception:
                pass  # a worker died meanwhile; the kill below cleans up
            for proc in self.workers:
                proc.join(timeout=10)
        self._stop_workers()


def start_workers(spec_fields: dict) -> tuple[list, dist.ProcessGroup, list]:
    """Spawn ranks 1..N-1, join the process group as rank 0, and wait until every worker holds its shard."""
    if dist.is_initialized():
        raise TuichatError("Another tensor-parallel model is loaded; close it first.")
    world = spec_fields["world"]
    if spec_fields["device"].startswith("cuda") and world > torch.cuda.device_count():
        raise TuichatError(f"--tp {world} needs {world} GPUs, but {torch.cuda.device_count()} are visible.")
    spec = WorkerSpec(init_method=f"tcp://127.0.0.1:{_free_port()}", **spec_fields)
    context = mp.get_context("spawn")  # fork would copy a process that already runs threads
    workers, pipes = [], []
    for rank in range(1, world):
        receiver, sender = context.Pipe(duplex=False)
        proc = context.Process(target=_worker_main, args=(spec, rank, sender), daemon=True,
                               name=f"tuichat-tp-rank{rank}")
        proc.start()
        workers.append(proc)
        pipes.append(receiver)
    try:
        plan_group = init_rank(spec, 0)
        for rank, pipe in enumerate(pipes, start=1):
            if not pipe.poll(_STARTUP_TIMEOUT_S):
                raise TuichatError(f"tensor-parallel worker {rank} did not start in {_STARTUP_TIMEOUT_S} s")
            message = pipe.recv()
            if message != "ready":
                raise TuichatError(f"tensor-parallel worker {rank} failed to start: {message}")
    except BaseException:
        for proc in workers:
            proc.terminate()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    return workers, plan_group, pipes
