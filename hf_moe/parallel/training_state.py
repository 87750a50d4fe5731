"""Training checkpoints that reshard on load: model and optimizer through `torch.distributed.checkpoint` (DCP), with
the LR scheduler, the RNG of every process and the position in the data.

    save_training_state(directory, model, optimizer, scheduler=scheduler, data_position={"step": 6, "samples": 48})
    position = load_training_state(directory, model, optimizer, scheduler=scheduler)  # any number of processes

Layout of `directory`:

    dcp/                  DCP: "model.*" and "optimizer.*" from `get_state_dict` (each process writes the shards it
                          holds; the metadata describes every tensor globally), "rng.rank{r}.*" each process's RNG
    scheduler.pt          the scheduler's state_dict (torch.save; read back with weights_only=True)
    training_state.json   format, world size and mesh of the run that wrote it, and the data position

On load, DCP gives every process the slices its current placement needs (DTensor shards under FSDP2 and expert
parallelism, full tensors on a single process), so a run saved on 4 processes resumes on 2 or on 1 with the same
weights and optimizer state, bit for bit. The save is atomic, with the commit of every hf_moe checkpoint
(`hf_moe.checkpoint.commit`): it is written into a locked staging directory beside `directory` and swapped into
place in one step only when every process has written its part; what a killed save leaves is removed by the next
save, and a state hidden by a kill between the two renames of the fallback commit is put back by the next load.
`training_state.json` and `scheduler.pt` are read through the guarded opener (`hf_moe.checkpoint.guard`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointError, read_json, reading, recover_interrupted_commit, resolve_output_directory
from ..checkpoint.commit import commit, discard, new_staging
from ..checkpoint.guard import check_regular, read_bytes

FORMAT = 1
STATE_FILE = "training_state.json"
SCHEDULER_FILE = "scheduler.pt"
DCP_DIR = "dcp"


class TrainingStateError(ValueError):
    """A training-state directory is missing, incomplete, or does not match the model and optimizer."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it "assumes" one process even when told so (no_dist=True); one process is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _broadcast(obj):
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_training_state(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler=None,
    data_position: dict[str, int] | None = None,
) -> None:
    """Write the training state to `directory` (every process must call it; see the module docstring).

    Args:
        data_position: where the run is in its data, as non-negative integers (e.g. the optimizer step and the
            number of samples consumed); returned as is by `load_training_state`.
    """
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    position = _check_position(dict(data_position or {}), "data_position")
    rank, world = _rank_world()
    target = resolve_output_directory(directory, "Cannot save the training state to")
    staging = None
    if rank == 0:
        staging = new_staging(target)  # (locked; removes what killed saves into `target` left)
    staging = Path(_broadcast(str(staging)))
    error = None
    try:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        with _single_process_quiet():
            save(
                {"model": model_state, "optimizer": optimizer_state, f"rng.rank{rank}": _rng_state()},
                checkpoint_id=staging / DCP_DIR,
                no_dist=not _distributed(),
            )
        if rank == 0:
            if scheduler is not None:
                torch.save(scheduler.state_dict(), staging / SCHEDULER_FILE)
            plan = getattr(model, "expert_parallel_plan", None)
            meta = {
                "format": FORMAT,
                "world_size": world,
                "mesh": None if plan is None else {"dp": plan.dp_size, "ep": plan.ep_size},
                "data_position": position,
            }
            (staging / STATE_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    except BaseException as err:  # every process must still reach the collectives below
        error = err
    failed = [error is not None]
    if _distributed():
        everyone: list = [None] * world
        dist.all_gather_object(everyone, error is not None)
        failed = everyone
    status = None
    if rank == 0:
        try:
            if any(failed):
                ranks = [r for r, f in enumerate(failed) if f]
                raise RuntimeError(f"saving the training state failed on rank(s) {ranks}")
            commit(staging, target, carry=False)  # (nothing of an older state is kept)
            status = "ok"
        except BaseException as err:
            discard(staging)
            status = f"{type(err).__name__}: {err}"
            error = error or err
    status = _broadcast(status)
    if error is not None:
        raise error
    if status != "ok":
        raise RuntimeError(f"Saving the training state to {target} failed on rank 0: {status}")


def _check_position(position, where: str) -> dict[str, int]:
    if not isinstance(position, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in position.items()
    ):
        raise TrainingStateError(
            f"{where} must map names to non-negative integers (e.g. {{'step': 6, 'samples': 48}}), got {position!r}."
        )
    return position


def _last_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def read_training_state_meta(directory: str | os.PathLike) -> dict:
    """The validated `training_state.json` of `directory` (raises TrainingStateError naming what is wrong)."""
    directory = Path(directory)
    recover_interrupted_commit(directory)
    path = directory / STATE_FILE
    if not os.path.lexists(path) or not os.path.lexists(directory / DCP_DIR / ".metadata"):
        raise TrainingStateError(
            f"{directory} is not a training state saved by hf_moe.parallel.save_training_state (it needs {STATE_FILE} "
            f"and {DCP_DIR}/.metadata). Point to the directory the save wrote, e.g. checkpoint-N/training_state."
        )
    try:
        check_regular(directory / DCP_DIR, ".metadata", "the training state")  # (DCP reads it: a file, inside)
        meta = read_json(directory, STATE_FILE, "the training state")
    except CheckpointError as err:
        raise TrainingStateError(f"{err} Save the training state again.") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TrainingStateError(
            f"{path} has format {meta.get('format') if isinstance(meta, dict) else meta!r}; this hf_moe reads format "
            f"{FORMAT}. Upgrade hf_moe, or save the training state again."
        )
    world = meta.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise TrainingStateError(f"{path}: world_size must be a positive integer, got {world!r}.")
    mesh = meta.get("mesh")
    if mesh is not None and not (
        isinstance(mesh, dict)
        and set(mesh) == {"dp", "ep"}
        and all(isinstance(v, int) and v > 0 for v in mesh.values())
    ):
        raise TrainingStateError(f"{path}: mesh must be null or {{'dp': int, 'ep': int}}, got {mesh!r}.")
    meta["data_position"] = _check_position(meta.get("data_position"), f"{path}: data_position")
    return meta


def load_training_state(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler=None,
) -> dict[str, int]:
    """Load a state written by `save_training_state` into `model`, `optimizer` (and `scheduler`), resharding it to
    their current placement, and restore this process's RNG. Returns the saved data position.

    Every process must call it. A process that the saving run did not have (resuming on more processes) keeps its
    RNG, with a warning.
    """
    directory = Path(directory)
    with reading(directory):  # (a save into it meanwhile waits for the load)
        return _load_training_state(directory, model, optimizer, scheduler)


def _load_training_state(directory: Path, model, optimizer, scheduler) -> dict[str, int]:
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = read_training_state_meta(directory)
    rank, world = _rank_world()
    reader = FileSystemReader(directory / DCP_DIR)
    saved = set(reader.read_metadata().state_dict_metadata)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    rng_keys = {k.split(".")[-1] for k in saved if k.startswith(f"rng.rank{rank}.")}
    if rng_keys:
        state[f"rng.rank{rank}"] = {k: v for k, v in _rng_state().items() if k in rng_keys}
    elif meta["world_size"] <= rank:
        warnings.warn(
            f"{directory} was saved by {meta['world_size']} process(es); process {rank} keeps its own RNG state.",
            stacklevel=2,
        )
    expected = {f"model.{k}" for k in model_state}
    missing = sorted(expected - saved)
    if missing:
        raise TrainingStateError(
            f"{directory} does not match this model: {len(missing)} tensor(s) are not in it, e.g. {missing[:3]}. "
            "Resume with the model (architecture, MoE layers, number of experts) that saved it."
        )
    try:
        with _single_process_quiet():
            load(state, storage_reader=reader, no_dist=not _distributed())
    except (Exception, CheckpointException) as err:  # DCP's exception derives from BaseException
        raise TrainingStateError(
            f"{directory} does not match this model and optimizer: {_last_line(err)}. Resume with the model "
            "(architecture, number of experts, sizes) and optimizer type (and parameter groups) that saved it."
        ) from err
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    rng = state.get(f"rng.rank{rank}", {})
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if scheduler is not None:
        path = directory / SCHEDULER_FILE
        if not os.path.lexists(path):
            raise TrainingStateError(f"{directory} has no {SCHEDULER_FILE}: it was saved without a scheduler.")
        try:
            data = read_bytes(directory, SCHEDULER_FILE, "the training state")
            scheduler_state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except CheckpointError as err:
            raise TrainingStateError(str(err)) from None
        if not isinstance(scheduler_state, dict):
            raise TrainingStateError(f"{path} is not a scheduler state_dict (got {type(scheduler_state).__name__}).")
        scheduler.load_state_dict(scheduler_state)
    return dict(meta["data_position"])
