"""Orbax checkpoints of the train state + the data iterator state, in `<run_dir>/checkpoints/`.

    ck = Checkpointer(run_dir, keep=3)
    ck.save(step, state, data_state)          # async: returns once device arrays are copied
    step = ck.latest_step()                   # newest COMPLETE checkpoint or None
    state, data_state = ck.restore(step, template_state)   # verified against its digest first
    ck.wait(); ck.close()

The train state tree is stored as a flat dict {"params.layers.0.attn.q.w": array, ...} so that it is
independent of Python container types; restore maps it back onto `template_state` (same structure,
shardings taken from the template). Orbax writes each step into a temporary folder and renames it
when complete, so a save interrupted by a crash is never listed; `latest_step` additionally requires
orbax's `commit_success.txt` (written last) and the data-state file of this process (written before
the state save begins), so a half-copied or half-written step folder is never picked.

Digests: once orbax has finalized a step's files and before it renames the step into place, process
0 writes `data_state/<step>/digest.json` (loading/digest.py: SHA-256 of every file of the step's state
and of its data states). A folder whose steps all have digests is sealed (`data_state/digests`) and
then only steps with a digest count as complete. Every restore checks the step against its digest
first (the processes of a multi-host run share it: each hashes 1/n of the step's blocks and they
agree on the first that differs, a collective); a step that differs is never read: one
CheckpointError names it, the newest earlier step that verifies, and how to use that one. Steps of
a folder written before digests existed are read unverified (`verified` is then False after restore).

Orbax's list of steps is never `reload()`ed: a reload while an async save is in flight drops that
step from the manager's list, which then keeps too many checkpoints and judges the wrong ones old.
A data state is deleted only once orbax has deleted its step folder (orbax deletes old steps after
the next save commits), so every checkpoint on disk keeps its data state. Saving a step that is
already saved or in flight is a no-op.

Layer layout: a checkpoint written with `runtime.scan_layers` stores stacked parameters
("params.stacks.<s>.blocks.<q>....", leading layer axis) where one without stores
"params.layers.<i>....". `restore` converts either into the other when the template has the other
layout (optimizer moments included; loading/layer_keys.py maps the keys): a run resumes across a change
of runtime.scan_layers. The stacks of a stacked checkpoint are read back from its own key names and shapes.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from farskip_jax.errors import CheckpointError, ConfigError
from farskip_jax.loading import layer_keys as stacking
from farskip_jax.loading.digest import digest_files, first_mismatch, read_digest, write_digest

SEALED = "digests"  # in data_state/: every committed step of this folder has a digest
DIGEST = "digest.json"  # in data_state/<step>/


def resume_hint(step: int) -> str:
    """How a training run resumes from checkpoint `step` (the default hint of Checkpointer.restore)."""
    return (f"re-run with train.resume_step={step} to resume from it (the steps after it are trained again and "
            "their checkpoints replaced), or set train.overwrite=true to start the run over")


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


def _first_over_processes(bad: int) -> int:
    """The smallest of the processes' `bad` block indices that is >= 0 (-1: none): a collective."""
    got = np.asarray(multihost_utils.process_allgather(np.array([bad], np.int64))).ravel()
    hits = got[got >= 0]
    return int(hits.min()) if hits.size else -1


class Checkpointer:
    def __init__(self, run_dir: str, *, keep: int = 3, async_save: bool = True):
        self.dir = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.data_dir = os.path.join(self.dir, "data_state")
        self.process = jax.process_index()
        self.sync = not async_save  # saves go through orbax's async path (its hook writes the digest), then wait
        self.verified: Optional[bool] = None  # whether the last restore was checked against a digest
        self._sealing: collections.deque = collections.deque()  # steps saved whose digest is not written yet
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True,
                                            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal))
        # the handler of the one item is named up front: a manager that only learns it from a save
        # warns twice ("Item 'state' ... could not be restored") when it reads a step's metadata first
        self.mngr = ocp.CheckpointManager(self.dir, options=opts,
                                          item_handlers={"state": ocp.StandardCheckpointHandler()})

    def _data_path(self, step: int) -> str:
        return os.path.join(self.data_dir, str(step), f"process_{self.process}.json")

    def _digest_path(self, step: int) -> str:
        return os.path.join(self.data_dir, str(step), DIGEST)

    def _files(self, step: int, root: str) -> dict:
        """{name in the digest: path} of step `step` whose folder is `root`: the files of its state
        (orbax's commit markers aside) and its data states."""
        out = {}
        state = os.path.join(root, "state")
        for d, _, fs in os.walk(state):
            for f in fs:
                if f != "commit_success.txt":
                    p = os.path.join(d, f)
                    out["state/" + os.path.relpath(p, state).replace(os.sep, "/")] = p
        ds = os.path.join(self.data_dir, str(step))
        for f in (os.listdir(ds) if os.path.isdir(ds) else []):
            if f.startswith("process_") and f.endswith(".json"):
                out["data_state/" + f] = os.path.join(ds, f)
        return out

    def _seal(self) -> None:
        """Orbax's hook, after a step's files are final and before it renames the step into place:
        process 0 writes the step's digest (so a committed step always has one). The step is the
        oldest pending one whose temporary folder is there (orbax finalizes saves in order)."""
        tmp = {int(d.split(".")[0]): d for d in os.listdir(self.dir) if ".orbax-checkpoint-tmp" in d
               and d.split(".")[0].isdigit()}
        step = next((s for s in self._sealing if s in tmp), self._sealing[0])
        while self._sealing and self._sealing[0] != step:
            self._sealing.popleft()
        self._sealing.popleft()
        if self.process == 0:
            root = os.path.join(self.dir, tmp.get(step, str(step)))
            write_digest(self._digest_path(step), digest_files(self._files(step, root)))

    def sealed(self) -> bool:
        """Whether every committed step of this folder has a digest (a folder this version started)."""
        return os.path.isfile(os.path.join(self.data_dir, SEALED))

    def _maybe_seal_folder(self) -> None:
        if self.process != 0 or self.sealed():
            return
        if all(os.path.isfile(self._digest_path(s)) for s in self._committed()):
            os.makedirs(self.data_dir, exist_ok=True)
            with open(os.path.join(self.data_dir, SEALED), "w") as f:
                f.write("every committed step of this folder has data_state/<step>/digest.json\n")

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
            self._maybe_seal_folder()
            self._sealing.append(step)
            if not self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(flatten_state(state))),
                                  force=force):
                self._sealing.remove(step)  # orbax chose not to save it: no digest will be due
            if self.sync:
                self.mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001 -- orbax and the OS raise many types; all mean "not written"
            raise self._write_failed(step, e) from None
        self._prune_data_states()

    def _write_failed(self, step: Optional[int], e: Exception) -> CheckpointError:
        """Remove what a failed save left (orbax temporary folders, data states without a committed
        step) and the error to raise."""
        self._sealing.clear()
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

    def _committed(self) -> list[int]:
        if not os.path.isdir(self.dir):
            return []
        return sorted(int(d) for d in os.listdir(self.dir) if d.isdigit() and os.path.isfile(self._commit_path(int(d))))

    def complete_steps(self) -> list[int]:
        """Step folders on disk that orbax has committed (its marker) and whose data state for this
        process exists (and, in a sealed folder, its digest). Read from the folder: orbax drops a step
        from its list when a newer save starts but deletes the folder only after that save commits,
        and until then the old step is the newest restorable one. A folder being deleted always has a
        newer committed one."""
        sealed = self.sealed()
        return [s for s in self._committed() if os.path.isfile(self._data_path(s))
                and (not sealed or os.path.isfile(self._digest_path(s)))]

    def check(self, step: int) -> Optional[str]:
        """None when committed step `step` matches its digest (or has none in a folder written before
        digests: `verified` is then False); else what differs."""
        digest = read_digest(self._digest_path(step))
        if digest is None:
            if self.sealed():
                return "its digest is missing"
            self.verified = False
            return None
        if not digest:
            return f"its digest {self._digest_path(step)} does not read"
        self.verified = True
        n = jax.process_count()  # several processes: each reads 1/n of the step (every one calls check)
        return first_mismatch(digest, self._files(step, os.path.join(self.dir, str(step))), (self.process, n),
                              _first_over_processes if n > 1 else None)

    def _corrupted(self, step: int, what: str, hint: Callable[[int], str]) -> CheckpointError:
        good = next((s for s in reversed(self.complete_steps()) if s < step and self.check(s) is None), None)
        fix = (f"the newest earlier step that matches its digest is {good}: {hint(good)}" if good is not None else
               f"no earlier step of {self.dir} matches its digest: set train.overwrite=true to start the run over, or "
               f"delete {os.path.join(self.dir, str(step))} yourself to start from step 0")
        return CheckpointError(f"checkpoint step {step} in {self.dir} cannot be restored: {what} (checked against the "
                               f"digest written when it was saved: its files were damaged or changed since); {fix}")

    def resume_step(self, requested: Optional[int] = None) -> Optional[int]:
        """The step a run resumes from: `requested` (train.resume_step; ConfigError when it is not a
        complete step here) or the newest complete one (None: none)."""
        steps = self.complete_steps()
        if requested is None:
            return steps[-1] if steps else None
        if requested not in steps:
            raise ConfigError(f"train.resume_step={requested} is not a complete checkpoint in {self.dir} (it has "
                              f"steps {steps}); choose one of those, or drop train.resume_step to resume from the newest")
        return requested

    def after_resume(self, step: Optional[int], requested: Optional[int]) -> list[str]:
        """Once the run folder is claimed: drop the steps after a train.resume_step (they are trained
        again); lines for the log on what was read."""
        out = []
        if step is not None and self.verified is False:
            out.append(f"checkpoint step {step} was written by a farskip_jax that wrote no digests: read without "
                       "verification (every checkpoint written from now on is verified when read)")
        if requested is not None:
            dropped = self.drop_after(step)
            out.append(f"train.resume_step={step}: resumed from checkpoint step {step}"
                       + (f"; dropped the later checkpoint steps {dropped} (trained again)" if dropped else ""))
        return out

    def drop_after(self, step: int) -> list[int]:
        """Delete the committed steps after `step` (train.resume_step: they are trained again); returns them."""
        newer = [s for s in self.mngr.all_steps() if s > step]
        for s in newer:
            self.mngr.delete(s)
            if self.process == 0:
                shutil.rmtree(os.path.join(self.data_dir, str(s)), ignore_errors=True)
        return newer

    def _commit_path(self, step: int) -> str:
        """Orbax writes this file last, just before renaming the temporary folder into place."""
        return os.path.join(self.dir, str(step), "commit_success.txt")

    def latest_step(self) -> Optional[int]:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def restore(self, step: int, template: Any, *, hint: Callable[[int], str] = resume_hint) -> tuple[Any, dict]:
        """(state shaped as `template`, data state) of committed step `step`, checked against its
        digest first; CheckpointError naming the step, the newest earlier good one and `hint(it)`."""
        self.verified = None
        bad = self.check(step)
        if bad is not None:
            raise self._corrupted(step, bad, hint)
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
