"""A decode step that folds with other layers' in one launch per token.

In the evicting steady state a member of a StepGroup (cache/group.py) writes
its token into the victim the group picked, attends with MLX's SDPA and
pushes its query; the last member's push folds every pushed query and picks
every member's next victim at once. Any other step (a mask, a cache not
full, another query shape) takes the member's metadata back from the group
and runs the inner step.
"""

from .base import Wrapper


class GroupedStep(Wrapper):
    def __init__(self, inner, group):
        super().__init__(inner)
        self.group = group
        self.scale = None  # the scale of the query this member last pushed
        group.add(self)

    def update(self, keys, values):
        c = self.cache
        if c.next_victim is None and self.group.waits_for(self):
            self.group.flush()  # a new token: last token's folds, every member's victim
        if c.into_victim():  # the steady state: its token is attended by SDPA
            return c.decode_into_victim(keys, values, for_sdpa=True)
        return self.inner.update(keys, values)  # (decode_step: sdpa_victims)

    def attend(self, queries, keys, values, scale, mask, sinks):
        c = self.cache
        if (c.written_slot is not None and mask is None and sinks is None and c.slots_used == c.max_size
                and self.group.takes(self, queries)):
            out = c.kv.sdpa(queries, keys, values, scale=scale)
            slot, self.scale = c.written_slot, scale
            c.written_slot, c.meta_pending, c.pending = None, False, False
            return self.group.push(self, queries, slot, out)
        self.sync()
        return self.inner.attend(queries, keys, values, scale, mask, sinks)

    def sync(self) -> None:
        """Take the metadata back from the group (it folds what is pending)."""
        if self.group.holds(self):
            self.group.release()
        self.inner.sync()

    def forget(self) -> None:
        self.sync()
        self.inner.forget()

    def take_victim(self, victim) -> None:
        """The group picked where this member's next token goes."""
        self.cache.next_victim = victim
