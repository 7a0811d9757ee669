"""Orbax checkpoints of the train state + the data iterator state, in `<run_dir>/checkpoints/`.

    ck = Checkpointer(run_dir, keep=3)
    ck.save(step, state, data_state)          # async: returns once device arrays are copied
    step = ck.latest_step()                   # newest COMPLETE checkpoint or None
    state, data_state = ck.restore(step, template_state)
    ck.wait(); ck.close()

The train state tree is stored as a flat dict {"params.layers.0.attn.q.w": array, ...} so that it is
independent of Python container types; restore maps it back onto `template_state` (same structure,
shardings taken from the template). Orbax writes each step into a temporary folder and renames it
when complete, so a save interrupted by a crash is never listed; `latest_step` additionally requires
orbax's `commit_success.txt` (written last) and the data-state file of this process (written before
the state save begins), so a half-copied or half-written step folder is never picked.

Orbax's list of steps is never `reload()`ed: a reload while an async save is in flight drops that
step from the manager's list, which then keeps too many checkpoints and judges the wrong ones old.
A data state is deleted only once orbax has deleted its step folder (orbax deletes old steps after
the next save commits), so every checkpoint on disk keeps its data state. Saving a step that is
already saved or in flight is a no-op.

Layer layout: a checkpoint written with `model.scan_layers` stores stacked parameters
("params.stacks.<s>.blocks.<q>....", leading layer axis) where one without stores
"params.layers.<i>....". `restore` converts either into the other when the template has the other
layout (optimizer moments included; convert/layer_keys.py maps the keys): a run resumes across a change
of model.scan_layers. The stacks of a stacked checkpoint are read back from its own key names and shapes.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from farskip_jax.errors import CheckpointError
from farskip_jax.convert import layer_keys as stacking


def _key_str(path) -> str:
    parts = []
    for p in path:
        if isinstance(p, jax.tree_util.DictKey):
            parts.append(str(p.key))
        elif isinstance(p, jax.tree_util.SequenceKey):
            parts.append(str(p.idx))
        elif isinstance(p, jax.tree_util.GetAttrKey):
            parts.append(p.name)
        elif isinstance(p, jax.tree_util.FlattenedIndexKey):
            parts.append(str(p.key))
        else:
            parts.append(str(p))
    return ".".join(parts)


def flatten_state(state: Any) -> dict:
    """Tree -> {dotted path: leaf}."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        k = _key_str(path)
        if k in flat:
            raise CheckpointError(f"two train-state leaves share the checkpoint key {k!r}")
        flat[k] = leaf
    return flat


def unflatten_state(flat: dict, template: Any) -> Any:
    paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = []
    for path, _ in paths:
        k = _key_str(path)
        if k not in flat:
            raise CheckpointError(f"checkpoint lacks {k!r}; it was written by a different model/optimizer config")
        leaves.append(flat[k])
    return jax.tree_util.tree_unflatten(treedef, leaves)


class Checkpointer:
    def __init__(self, run_dir: str, *, keep: int = 3, async_save: bool = True):
        self.dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.data_dir = os.path.join(self.dir, "data_state")
        self.process = jax.process_index()
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        # the handler of the one item is named up front: a manager that only learns it from a save
        # warns twice ("Item 'state' ... could not be restored") when it reads a step's metadata first
        self.mngr = ocp.CheckpointManager(self.dir, options=opts,
                                          item_handlers={"state": ocp.StandardCheckpointHandler()})

    def _data_path(self, step: int) -> str:
        return os.path.join(self.data_dir, str(step), f"process_{self.process}.json")

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = True) -> None:
        """Save `step` (async unless async_save=False). A save that fails (full disk, I/O error) leaves
        no partial step behind and raises CheckpointError naming the folder and the step to resume from."""
        if step in self.mngr.all_steps():  # saved already, or still being written by the async save
            return
        path = self._data_path(step)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data_state, f)
            os.replace(tmp, path)
            self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flatten_state(state))),
                           force=force)
        except Exception as e:  # noqa: BLE001 -- orbax and the OS raise many types; all mean "not written"
            raise self._write_failed(step, e) from None
        self._prune_data_states()

    def _write_failed(self, step: Optional[int], e: Exception) -> CheckpointError:
        """Remove what a failed save left (orbax temporary folders, data states without a committed
        step) and the error to raise."""
        if os.path.isdir(self.dir):
            for d in os.listdir(self.dir):
                if ".orbax-checkpoint-tmp" in d:
                    shutil.rmtree(os.path.join(self.dir, d), ignore_errors=True)
        done = set(self.complete_steps())
        if os.path.isdir(self.data_dir):
            for d in os.listdir(self.data_dir):
                if d.isdigit() and not os.path.isfile(self._commit_path(int(d))):
                    shutil.rmtree(os.path.join(self.data_dir, d), ignore_errors=True)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        latest = max(done) if done else None
        return CheckpointError(
            f"checkpoint{'' if step is None else f' step {step}'} could not be written to {self.dir} "
            f"({type(e).__name__}: {first}); nothing partial was kept. Free disk space (or choose a train.run_dir "
            "on a disk with room) and re-run the same command: it resumes from "
            + (f"step {latest}" if latest is not None else "the start"))

    def _prune_data_states(self) -> None:
        """Delete the data states of steps orbax has dropped AND already deleted from disk (it deletes
        old steps only after the next save commits, so until then the old step stays restorable)."""
        if self.process != 0 or not os.path.isdir(self.data_dir):
            return
        tracked = set(self.mngr.all_steps())
        if not tracked:
            return
        newest = max(tracked)
        for d in os.listdir(self.data_dir):
            if (d.isdigit() and int(d) < newest and int(d) not in tracked
                    and not os.path.exists(os.path.join(self.dir, d))):
                shutil.rmtree(os.path.join(self.data_dir, d), ignore_errors=True)

    def complete_steps(self) -> list[int]:
        """Step folders on disk that orbax has committed (its marker) and whose data state for this
        process exists. Read from the folder: orbax drops a step from its list when a newer save
        starts but deletes the folder only after that save commits, and until then the old step is
        the newest restorable one. A folder being deleted always has a newer committed one."""
        if not os.path.isdir(self.dir):
            return []
        return sorted(int(d) for d in os.listdir(self.dir)
                      if d.isdigit() and os.path.isfile(self._data_path(int(d)))
                      and os.path.isfile(self._commit_path(int(d))))

    def _commit_path(self, step: int) -> str:
        """Orbax writes this file last, just before renaming the temporary folder into place."""
        return os.path.join(self.dir, str(step), "commit_success.txt")

    def latest_step(self) -> Optional[int]:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def restore(self, step: int, template: Any) -> tuple[Any, dict]:
        flat_t = flatten_state(template)
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=getattr(v, "sharding", None))
                    for k, v in flat_t.items()}
        convert = self._layout_conversion(step, abstract)
        if convert is not None:
            abstract, convert = convert
        try:
            out = self.mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        except Exception as e:
            raise CheckpointError(self._unreadable(step, e)) from None
        if convert is not None:
            out = {"state": convert(dict(out["state"]))}
        try:
            with open(self._data_path(step)) as f:
                data_state = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(self._unreadable(step, e)) from None
        return unflatten_state(dict(out["state"]), template), data_state

    def _stored(self, step: int) -> Optional[dict]:
        """{key: shape} of the state saved at `step`, or None when orbax's metadata does not read."""
        try:
            tree = self.mngr.item_metadata(step)["state"]
            return {k: tuple(v.shape) for k, v in tree.items()}
        except Exception:  # noqa: BLE001 -- unreadable metadata: the plain restore reports it
            return None

    def _layout_conversion(self, step: int, abstract: dict):
        """(abstract target in the checkpoint's layer layout, fn converting its restored flat dict to
        the template's) when the checkpoint's layout (per-layer / stacked) differs from the
        template's; None when they agree or the keys match neither way (the plain restore reports it)."""
        stored = self._stored(step)
        if stored is None or set(stored) == set(abstract):
            return None
        want = set(abstract)
        if stacking.is_stacked_layout(want) and stacking.is_layer_layout(stored):  # per-layer -> stacked
            segs = stacking.segments_from_keys({k: v.shape for k, v in abstract.items()})
            src = {}
            for k in stored:
                tk, r = stacking.stacked_key(k, segs)
                if tk not in abstract:
                    return None
                t = abstract[tk]
                src[k] = t if r < 0 else jax.ShapeDtypeStruct(t.shape[1:], t.dtype, sharding=_drop_lead(t.sharding))
            if set(stacking.stack_flat(dict.fromkeys(stored, 0), segs, stack=len)) != want:
                return None
            return src, lambda flat: _place(stacking.stack_flat(flat, segs), abstract)
        if stacking.is_layer_layout(want) and stacking.is_stacked_layout(stored):  # stacked -> per-layer
            segs = stacking.segments_from_keys(stored)
            src = {}
            for k, shape in stored.items():
                rows = stacking.layer_key(k, segs)
                if any(lk not in abstract for lk, _ in rows):
                    return None
                t = abstract[rows[0][0]]
                src[k] = t if rows[0][1] < 0 else jax.ShapeDtypeStruct(shape, t.dtype, sharding=_add_lead(t.sharding))
            if {lk for k in stored for lk, _ in stacking.layer_key(k, segs)} != want:
                return None
            return src, lambda flat: _place(stacking.unstack_flat(flat, segs), abstract)
        return None

    def _unreadable(self, step: int, e: Exception) -> str:
        """The message for a step whose files do not restore (truncated, corrupted, another model)."""
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        older = [s for s in self.complete_steps() if s < step]
        fix = (f"delete {os.path.join(self.dir, str(step))} to resume from step {older[-1]}" if older
               else f"delete {self.dir} to start from step 0")
        return (f"checkpoint step {step} in {self.dir} cannot be restored ({type(e).__name__}: {first}); its files "
                f"are truncated or were written by another model/optimizer config: {fix}, or set "
                "train.overwrite=true to start the run over")

    def wait(self) -> None:
        try:
            self.mngr.wait_until_finished()  # an async save's error surfaces here
        except Exception as e:  # noqa: BLE001
            raise self._write_failed(None, e) from None
        self._prune_data_states()

    def close(self) -> None:
        self.wait()
        self.mngr.close()


def _drop_lead(sharding):
    """The sharding of one row of an array sharded as `sharding` (its leading layer axis dropped)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
    return sharding


def _add_lead(sharding):
    """The sharding of rows stacked on a new, unsharded leading axis."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(None, *tuple(sharding.spec)))
    return sharding


def _place(flat: dict, abstract: dict) -> dict:
    """Each array of `flat` on the sharding of its template entry."""
    return {k: jax.device_put(v, abstract[k].sharding) if abstract[k].sharding is not None else v
            for k, v in flat.items()}
