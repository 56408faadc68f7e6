"""Objects of this package that hold threads, sockets or shared memory belong to the
process that made them. A child forked after that inherits them without their threads,
and their sockets stay shared with the parent: the child must not wait for those
threads, write to those sockets, or shut them down. Each such object is tracked here and
told once, in the child, right after the fork (``_after_fork_in_child``), to let its
threads and connections go without touching what the parent still uses. The library's
own handles do the same on their side (``mooncake.h``, "Processes")."""

import os
import weakref

_TRACKED = weakref.WeakSet()


def track(obj):
    """Tells ``obj`` (which has ``_after_fork_in_child()``) about forks from now on."""
    _TRACKED.add(obj)


def refusal(what, pid):
    """The message for a call a forked child makes on what process ``pid`` set up."""
    return (f"this {what} was set up in process {pid} before it forked; its threads and "
            f"connections stay with that process: set up a new {what} in this one (or "
            f"start child processes with the 'spawn' method)")


def _tell_the_child():
    for obj in list(_TRACKED):
        try:
            obj._after_fork_in_child()
        except Exception:  # noqa: BLE001 - one object's trouble must not stop the rest
            pass


os.register_at_fork(after_in_child=_tell_the_child)
