"""One diffusion request over several devices: classifier-free-guidance parallel and Ulysses
sequence parallel (the ``parallel`` option of a ``diffusion`` stage).

A replica with ``parallel: {cfg: C, ulysses: U}`` is a group of ``C * U`` rank processes: the
stage's worker is rank 0 and starts the others (`RankGroup`), one per device. Every rank runs the
same model part on the same requests (SPMD): rank 0's runtime schedules as usual and sends each
call it makes on its model part (prepare, start, denoise, drop) to the other ranks first, over a
pipe, so every rank holds the same samples and scheduler state. Inside `denoise` the ranks split
the work and exchange tensors through torch.distributed (NCCL on CUDA, gloo on CPU), with the
helpers of `Parallel`:

- CFG-parallel: rank ``r`` computes the rows (sample x guidance branch) of the branches ``b`` with
  ``b % C == r // U``; `Parallel.combine_rows` gives every rank every row's prediction, so the
  guidance and scheduler step that follow are the same on every rank.
- Ulysses: each rank holds ``1/U`` of the image/video tokens (`Parallel.shard`); around attention
  `Parallel.seq_to_heads` / `heads_to_seq` (all-to-all) swap that for all tokens of ``1/U`` of
  the heads; `Parallel.gather` joins the tokens again after the stack.

Rank 0 alone decodes. A rank that dies ends rank 0 too (`RankGroup` watches them), so the stage
group fails the replica's requests and restarts the whole group; the other ranks end when rank 0
does. torch is imported lazily.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import attrs

from omni_core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from omni_core.config.resolved import ResolvedPipeline, ResolvedStage

logger = logging.getLogger(__name__)

PARALLEL_MODES = ("cfg", "ulysses")
RANK_DIED_EXIT_CODE = 70  # rank 0's exit code when another rank of its group died
FAIL_GRACE_S = 2.0  # how long rank 0 lives on after another rank died (to fail its requests)


class RankFailure(RuntimeError):
    """Another rank of the replica's group died: the worker fails its requests and ends, and the
    stage group restarts the replica with a new group (`StageRuntime.step`)."""

    restart_worker = True


@attrs.frozen
class ParallelConfig:
    """How one replica of a diffusion stage spans devices: ``cfg`` ranks split the guidance
    branches, each with ``ulysses`` ranks that split the tokens; ``cfg * ulysses`` ranks in all."""

    cfg: int = attrs.field(
        default=1,
        validator=[attrs.validators.instance_of(int), attrs.validators.in_((1, 2))],
        metadata={"doc": "Ranks over the guidance branches: 2 puts the conditional and unconditional rows on different devices."},
    )
    ulysses: int = attrs.field(
        default=1,
        validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)],
        metadata={"doc": "Ranks over the image/video tokens (Ulysses sequence parallel); the heads must split over them."},
    )

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses

    @property
    def modes(self) -> list[str]:
        return [name for name in PARALLEL_MODES if getattr(self, name) > 1]


def check_parallel(config: ParallelConfig, stage: "ResolvedStage", supported: frozenset[str] | None, key: str) -> None:
    """Refuse a ``parallel`` setting this stage cannot run (at resolve time, as a `ConfigError`)."""
    if config.world_size == 1:
        return
    unsupported = [mode for mode in config.modes if mode not in (supported or frozenset())]
    if unsupported:
        raise ConfigError(
            f"the model part of stage {stage.name!r} does not support {' or '.join(unsupported)} parallelism "
            f"(it supports: {', '.join(sorted(supported or ())) or 'none'})",
            key=key,
        )
    if stage.placement == "inline":
        raise ConfigError(
            f"stage {stage.name!r} spans {config.world_size} rank processes: place it in a process "
            f"(--set {stage.name}.placement=process), not inline",
            key=f"stages.{stage.name}.placement",
        )
    if stage.devices and len(stage.devices) < config.world_size:
        raise ConfigError(
            f"stage {stage.name!r} needs {config.world_size} devices for parallel {attrs.asdict(config)}, "
            f"its devices are {list(stage.devices)}",
            key=f"stages.{stage.name}.devices",
        )


def check_heads(config: ParallelConfig, heads: int, where: str) -> None:
    """Refuse Ulysses ranks that the attention heads (`heads`, read from `where`) do not split over."""
    if heads % config.ulysses:
        raise ConfigError(f"ulysses {config.ulysses} does not divide the {heads} attention heads of {where}: use a divisor of {heads}")


def rank_devices(stage_devices: tuple[str, ...], world_size: int, cuda: bool) -> list[str]:
    """The device of each rank: the stage's devices (as its process sees them), else the first
    visible GPUs, else the CPU for every rank."""
    if stage_devices:
        return list(stage_devices[:world_size])
    if cuda:
        return [f"cuda:{rank}" for rank in range(world_size)]
    return ["cpu"] * world_size


@attrs.frozen(eq=False)
class Parallel:
    """This rank's place in its group and the collectives a model part's `denoise` uses.

    With one rank (`SINGLE`) every helper returns its input: a model part can call them always.
    Ranks are numbered ``cfg_rank * ulysses + ulysses_rank``.
    """

    cfg: int = 1
    ulysses: int = 1
    rank: int = 0
    cfg_group: Any = None  # the ranks with this rank's ulysses_rank (a torch.distributed group)
    ulysses_group: Any = None  # the ranks with this rank's cfg_rank

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.ulysses

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses

    # -- CFG-parallel ----------------------------------------------------------------------------

    def owns_branch(self, branch: int) -> bool:
        """Whether this rank computes the rows of guidance branch `branch` (0: conditional)."""
        return branch % self.cfg == self.cfg_rank

    def combine_rows(self, local: "torch.Tensor", local_rows: list[int], total_rows: int) -> "torch.Tensor":
        """Every row's tensor on every rank, from each rank's own rows (`local` holds the rows
        `local_rows` of `total_rows`, in that order). Exact: each row comes from one rank."""
        if self.cfg == 1:
            return local
        import torch
        import torch.distributed as dist

        full = local.new_zeros(total_rows, *local.shape[1:])
        if local_rows:
            full.index_copy_(0, torch.tensor(local_rows, device=local.device), local)
        dist.all_reduce(full, group=self.cfg_group)
        return full

    # -- Ulysses ---------------------------------------------------------------------------------

    def padded(self, length: int) -> int:
        """`length` tokens rounded up to a multiple of the Ulysses ranks."""
        return -(-length // self.ulysses) * self.ulysses

    def shard(self, x: "torch.Tensor", dim: int = 1) -> "torch.Tensor":
        """This rank's share of `x`'s tokens along `dim`, after zero-padding them to `padded`."""
        if self.ulysses == 1:
            return x
        import torch.nn.functional as F

        length = x.shape[dim]
        extra = self.padded(length) - length
        if extra:
            pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
            x = F.pad(x, pad)
        return x.chunk(self.ulysses, dim=dim)[self.ulysses_rank].contiguous()

    def gather(self, x: "torch.Tensor", length: int, dim: int = 1) -> "torch.Tensor":
        """The tokens of every rank's shard joined along `dim`, the padding cut off (`length`)."""
        if self.ulysses == 1:
            return x
        import torch
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.ulysses)]
        dist.all_gather(parts, x, group=self.ulysses_group)
        return torch.cat(parts, dim=dim).narrow(dim, 0, length)

    def seq_to_heads(self, x: "torch.Tensor") -> "torch.Tensor":
        """[B, S/U, H, D] (a share of the tokens, all heads) -> [B, S, H/U, D] (all tokens, a share
        of the heads), by one all-to-all over the Ulysses ranks."""
        if self.ulysses == 1:
            return x
        b, s, h, d = x.shape
        u = self.ulysses
        if h % u:
            raise ValueError(f"{h} heads do not split over {u} Ulysses ranks")
        send = x.reshape(b, s, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()  # [U, B, s, H/U, D]
        received = self._all_to_all(send)  # [U (token share), B, s, H/U, D]
        return received.permute(1, 0, 2, 3, 4).reshape(b, u * s, h // u, d)

    def heads_to_seq(self, x: "torch.Tensor") -> "torch.Tensor":
        """[B, S, H/U, D] -> [B, S/U, H, D]: the inverse of `seq_to_heads`."""
        if self.ulysses == 1:
            return x
        b, seq, h, d = x.shape
        u = self.ulysses
        send = x.reshape(b, u, seq // u, h, d).permute(1, 0, 2, 3, 4).contiguous()  # [U (token share), B, s, H/U, D]
        received = self._all_to_all(send)  # [U (head share), B, s, H/U, D]
        return received.permute(1, 2, 0, 3, 4).reshape(b, seq // u, u * h, d)

    def head_share(self, x: "torch.Tensor", heads_dim: int = 2) -> "torch.Tensor":
        """This rank's heads of a tensor every rank holds whole (e.g. keys of a text context)."""
        if self.ulysses == 1:
            return x
        return x.chunk(self.ulysses, dim=heads_dim)[self.ulysses_rank]

    def sum_over_tokens(self, x: "torch.Tensor") -> "torch.Tensor":
        """`x` (partial sums over this rank's tokens) summed over the Ulysses ranks, in place."""
        if self.ulysses == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.ulysses_group)
        return x

    def _all_to_all(self, send: "torch.Tensor") -> "torch.Tensor":
        import torch
        import torch.distributed as dist

        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.ulysses_group)
        return received


SINGLE = Parallel()


def init_parallel(config: ParallelConfig, rank: int, device: str, store: Any) -> Parallel:
    """Join the group's process group (every rank calls this) and build this rank's `Parallel`."""
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        import torch

        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, store=store, rank=rank, world_size=config.world_size)
    cfg, ulysses = config.cfg, config.ulysses
    cfg_group = ulysses_group = None
    # Every rank creates every group, in the same order (torch.distributed requires it).
    for u in range(ulysses):
        group = dist.new_group([c * ulysses + u for c in range(cfg)]) if cfg > 1 else None
        if rank % ulysses == u:
            cfg_group = group
    for c in range(cfg):
        group = dist.new_group([c * ulysses + u for u in range(ulysses)]) if ulysses > 1 else None
        if rank // ulysses == c:
            ulysses_group = group
    return Parallel(cfg=cfg, ulysses=ulysses, rank=rank, cfg_group=cfg_group, ulysses_group=ulysses_group)


# -- the group of rank processes ---------------------------------------------------------------


class RankGroup:
    """Rank 0's side of a replica's rank processes: starts ranks 1.., sends them rank 0's model
    calls, and ends this process if one of them dies (the stage group then restarts the replica).

    The ranks are plain subprocesses of this interpreter (a stage worker is a daemonic
    multiprocessing child, which may not start multiprocessing children of its own); each reads
    its setup, then rank 0's calls, pickled from its stdin.
    """

    def __init__(
        self, pipeline: "ResolvedPipeline", stage: "ResolvedStage", replica: int, config: ParallelConfig,
        devices: list[str], spec: dict[str, Any],
    ) -> None:
        import subprocess

        import torch.distributed as dist

        self.config = config
        self.stage = stage
        self.replica = replica
        self.devices = devices
        self._closing = False
        self._failed = threading.Event()
        self._closed = threading.Event()
        self.failure = ""
        self._send_lock = threading.Lock()
        # Rank 0 hosts the rendezvous on a port the kernel picks: nothing to collide with.
        self.store = dist.TCPStore("127.0.0.1", 0, config.world_size, is_master=True, wait_for_workers=False)
        level = logging.getLogger().level or logging.WARNING
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(1, config.world_size):
            process = subprocess.Popen(
                [sys.executable, "-c", "from omni_core.stages.diffusion_parallel import rank_main; rank_main()"],
                stdin=subprocess.PIPE,
            )
            setup = (pipeline.to_dict(), stage.name, replica, rank, attrs.asdict(config), devices[rank], spec, self.store.port, level)
            assert process.stdin is not None
            pickle.dump(setup, process.stdin)
            process.stdin.flush()
            self.processes.append(process)
        for rank, process in enumerate(self.processes, start=1):
            threading.Thread(target=self._watch, args=(rank, process), name=f"omni-{stage.name}-{replica}-rank{rank}", daemon=True).start()
        self.parallel = init_parallel(config, 0, devices[0], self.store)

    def describe(self) -> list[dict[str, Any]]:
        """Each rank's process and device (rank 0 is this process)."""
        pids = [os.getpid(), *(p.pid for p in self.processes)]
        return [{"rank": rank, "pid": pid, "device": device} for rank, (pid, device) in enumerate(zip(pids, self.devices))]

    def send(self, *call: Any) -> None:
        """Make every other rank do `call` (``(name, *args)``, see `_follow`) on its model part."""
        data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            for process in self.processes:
                assert process.stdin is not None
                try:
                    process.stdin.write(data)
                    process.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass  # it died: its watcher ends this process

    def _watch(self, rank: int, process: Any) -> None:
        code = process.wait()
        if self._closing:
            return
        self.failure = f"rank {rank} of {self.config.world_size} exited (code {code}); the replica restarts"
        self._failed.set()
        logger.error("stage %s replica %d: %s", self.stage.name, self.replica, self.failure)
        # Rank 0's collective with the dead rank fails (gloo: the runtime raises `RankFailure`, its
        # worker fails the requests and ends) or may never return (NCCL): then end it from here.
        if not self._closed.wait(FAIL_GRACE_S):
            os._exit(RANK_DIED_EXIT_CODE)

    def check(self, error: BaseException) -> None:
        """Raise what killed the group if `error` (from a model call) came from a dead rank."""
        if self._failed.wait(FAIL_GRACE_S / 2):
            raise RankFailure(self.failure) from error

    def close(self, timeout: float = 30.0) -> None:
        import subprocess

        import torch.distributed as dist

        self._closing = True
        if self._failed.is_set():
            timeout = 0.0  # the others may be stuck in a collective with the dead one
        else:
            self.send("close")
        for process in self.processes:
            if process.stdin is not None:
                try:
                    process.stdin.close()
                except OSError:
                    pass
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if dist.is_initialized() and not self._failed.is_set():
            dist.destroy_process_group()
        self._closed.set()


def rank_main() -> None:
    """A rank process above 0: read its setup from stdin, load the model part, then do the calls
    rank 0 sends until it closes."""
    stream = sys.stdin.buffer
    pipeline_dict, stage_name, replica, rank, config, device, spec, port, log_level = pickle.load(stream)
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [{stage_name}:{replica} rank {rank}] %(name)s: %(message)s")
    from omni_core.config.resolved import ResolvedPipeline
    from omni_core.runtime.replica import prepare_worker_process

    pipeline = ResolvedPipeline.from_dict(pipeline_dict)
    stage = prepare_worker_process(pipeline.stage(stage_name))
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()

    import torch.distributed as dist

    from omni_core.parts import PartContext, build_part
    from omni_core.stages.diffusion_model import DiffusionModel, LoadSpec

    parallel_config = ParallelConfig(**config)
    store = dist.TCPStore("127.0.0.1", port, parallel_config.world_size, is_master=False)
    parallel = init_parallel(parallel_config, rank, device, store)
    model = build_part(stage.model, PartContext(pipeline, stage, replica=replica), DiffusionModel, f"stage {stage_name!r} model part")
    model.load(LoadSpec(**{**spec, "device": device, "parallel": parallel}))
    try:
        _follow(model, lambda: pickle.load(stream))
    except EOFError:
        pass  # rank 0 is gone
    finally:
        model.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _follow(model: Any, receive: Callable[[], Any]) -> None:
    """Repeat rank 0's calls on this rank's model part, on this rank's copy of the samples."""
    from omni_core.stages.diffusion_cache import CacheState

    samples: dict[str, list[Any]] = {}

    def pick(keys: list[tuple[str, int]]) -> list[Any]:
        return [samples[request_id][index] for request_id, index in keys]

    while True:
        name, *args = receive()
        if name == "prepare":
            request_id, data, params, cache = args
            prepared = model.prepare(request_id, data, params)
            for sample in prepared:
                sample.cache = CacheState(cache) if cache.enabled else None
            samples[request_id] = prepared
        elif name == "start":
            group = pick(args[0])
            model.start(group)
            for sample in group:
                sample.started = True
        elif name == "denoise":
            group = pick(args[0])
            model.denoise(group)
            for sample in group:
                sample.step += 1
        elif name == "drop":
            for request_id in args[0]:
                samples.pop(request_id, None)
        elif name == "close":
            return
        else:
            raise RuntimeError(f"unknown rank call {name!r}")


def _exit_with_parent(parent: int) -> None:
    """End this rank when rank 0 (its parent) has gone, whatever it is blocked in."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def sample_keys(samples: list[Any]) -> list[tuple[str, int]]:
    """How rank 0 names samples to the other ranks."""
    return [(sample.request_id, sample.index) for sample in samples]

