"""Checkpointer keep-last-K with async orbax saves: every checkpoint orbax keeps has its data state.

The trainer and the distill loop ask `latest_step()` between async saves; that must neither make
orbax forget an in-flight step (it then keeps too many checkpoints) nor get the data state of a
kept, restorable checkpoint deleted.
"""

import os

import jax.numpy as jnp
import numpy as np

from farskip_jax.loading.checkpoint import Checkpointer


def _state(s):
    return {"w": jnp.full((256, 256), float(s)), "step": jnp.asarray(s, jnp.int32)}


def _on_disk(ck):
    """Step folders orbax has committed, and steps with a data-state folder."""
    committed = {int(d) for d in os.listdir(ck.dir)
                 if d.isdigit() and os.path.isfile(os.path.join(ck.dir, d, "commit_success.txt"))}
    data = {int(d) for d in os.listdir(ck.data_dir) if d.isdigit()}
    return committed, data


def _check_every_committed_step_restorable(ck):
    committed, data = _on_disk(ck)
    assert committed <= data, f"committed checkpoints {sorted(committed)} lack data states: have {sorted(data)}"


def test_keep3_async_saves_keep_exactly_the_kept_data_states(tmp_path):
    ck = Checkpointer(str(tmp_path), keep=3)  # async on, as in the trainer
    for s in range(1, 6):
        ck.save(s, _state(s), {"next": s})
        latest = ck.latest_step()  # what the loops do between saves (it used to reload orbax's list)
        assert latest in (s - 1 if s > 1 else None, s), (s, latest)
        _check_every_committed_step_restorable(ck)
    assert ck.mngr.all_steps() == [3, 4, 5]
    ck.wait()
    committed, data = _on_disk(ck)
    assert committed == data == {3, 4, 5}
    assert sorted(int(d) for d in os.listdir(ck.dir) if d[0].isdigit()) == [3, 4, 5]  # nothing leaked
    assert ck.complete_steps() == [3, 4, 5] and ck.latest_step() == 5
    ck.save(5, _state(99), {"next": 99})  # already saved: a no-op, not a second write
    ck.wait()
    restored, data_state = ck.restore(3, _state(0))
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.full((256, 256), 3.0))
    assert int(restored["step"]) == 3 and data_state == {"next": 3}
    ck.close()
    ck2 = Checkpointer(str(tmp_path), keep=3)  # a resumed process sees the same
    assert ck2.complete_steps() == [3, 4, 5]
    assert ck2.restore(5, _state(0))[1] == {"next": 5}
    ck2.close()


def test_keep1_previous_checkpoint_stays_restorable_while_the_next_is_written(tmp_path):
    """Orbax deletes step s-1 only after step s commits; its data state must live as long."""
    ck = Checkpointer(str(tmp_path), keep=1)
    for s in range(1, 4):
        ck.save(s, _state(s), {"next": s})
        _check_every_committed_step_restorable(ck)
        assert ck.latest_step() in (s - 1 if s > 1 else None, s), s
    ck.close()
    assert _on_disk(ck) == ({3}, {3})
