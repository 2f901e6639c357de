"""Undo for one engine step: save an object's fields the first time the step touches it, and
put them back if the step fails.

An engine step changes many objects: the scheduler's queues and counters, requests and their
sequences, the block manager's tables, pools and prefix cache (or V1's block pool, or the
radix tree). ``LLMEngine.step`` is all or nothing, so every one of them must be put back
exactly when the step fails. Writing a ``snapshot()`` / ``restore()`` pair by hand in each
class means remembering every new field in two more methods; here there is one mechanism,
:class:`Checkpoint`, with two ways of saving:

* **Copy on first touch.** ``touch(obj)`` copies the object's fields (``__dict__`` or
  ``__slots__``, whatever they are) the first time a step touches it; later touches cost a
  dict lookup. Containers in fields (list, dict, set, bytearray, deque, and containers of
  containers) are copied, and put back *in place*, so that anyone holding the same list or
  dict sees it restored too; anything else in a field (a number, a string, a tuple, another
  object) is kept by reference: another object is touched on its own, or it is not part of
  the step's state. A field added to a class tomorrow is saved without anyone remembering.
  Two class attributes tune it: ``__rollback_append_only__`` names lists a step only grows
  at the end (their length and last item are saved, not their items: a sequence's output
  tokens, a block table's block ids, whose copy-on-write replaces the last one), and
  ``__rollback_skip__`` names fields that are not state (a lock, a reference to a
  configuration object that never changes).
* **A log of undos**, for a structure too large to copy each step: the waiting queue, which
  holds every request not yet admitted (``watch(queue)`` calls its ``begin_log()``, the queue
  records the moves the step makes, rollback calls ``undo(log)``), or the V1 scheduler's map
  of every request (``on_rollback(undo)`` for each entry a step takes out). Two logs are
  kept here for any class: ``save_items(container, keys)`` keeps the items a step is about
  to change of a large list, bytearray or dict (the first save of an item wins; a missing
  key is saved as absent), and ``save_stack(stack, cut_to)`` keeps a stack (a list changed
  only at its end) by the least length it had in the step and the items cut from below it:
  V0's pools and prefix cache (``memory/v0/``) use them for their ref counts, states, free
  stacks and hash maps, so that a step costs what it changed, not the size of the pool.

What to touch is decided by who knows it: ``course_lib/engine/rollback.py`` lists, once per
design (V0, V1, radix), the objects a step may change when it begins; the scheduler touches a
waiting request the moment it first changes it, so the cost grows with what the step touches,
never with the waiting queue. ``rollback()`` cannot fail half-way on bad state: it only
assigns fields and refills containers, with no call into the classes it restores.
"""

from __future__ import annotations

import operator
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, NamedTuple

#: container types copied (and put back in place); exact types only, so that a subclass
#: such as the waiting queue (a deque with its own log) is not copied wholesale
_CONTAINERS = (list, dict, set, bytearray, deque, OrderedDict)


class _Saved:
    """A container as it was: the object itself and a copy of its items (an item that is a
    container itself saved the same way: a dict of lists). A container's items are taken to
    be alike: the first one tells whether they are containers (checking each would make
    saving a list of a million ints a Python loop)."""

    __slots__ = ("obj", "items", "nested")

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        t = type(obj)
        if t is dict or t is OrderedDict:
            self.nested = type(next(iter(obj.values()), None)) in _CONTAINERS
            self.items = {k: _save(v) for k, v in obj.items()} if self.nested else obj.copy()
        else:                                            # list, set, bytearray, deque
            self.nested = t is not bytearray and type(next(iter(obj), None)) in _CONTAINERS
            self.items = [_save(v) for v in obj] if self.nested else \
                (obj[:] if t is list or t is bytearray else t(obj))

    def copy(self) -> Any:
        """A new container with the saved items (inner containers copied too)."""
        if not self.nested:
            return self.items.copy() if type(self.items) is not deque else deque(self.items)
        if isinstance(self.items, dict):
            return type(self.obj)({k: _copy(s) for k, s in self.items.items()})
        return type(self.obj)([_copy(s) for s in self.items])

    def put_back(self) -> Any:
        """Refill the original container with what it held; returns it."""
        obj, t, items = self.obj, type(self.obj), self.items
        if self.nested:
            items = {k: _put_back(s) for k, s in items.items()} if isinstance(items, dict) \
                else [_put_back(s) for s in items]
        if t is list or t is bytearray:
            obj[:] = items
        elif t is deque:
            obj.clear()
            obj.extend(items)
        else:                                            # dict, OrderedDict, set
            obj.clear()
            obj.update(items)
        return obj


def _save(value: Any) -> Any:
    return _Saved(value) if type(value) in _CONTAINERS else value


def _put_back(saved: Any) -> Any:
    return saved.put_back() if type(saved) in (_Saved, _Appended) else saved


def _copy(saved: Any) -> Any:
    return saved.copy() if type(saved) in (_Saved, _Appended) else saved


class _Appended:
    """A list a step only grows at the end: O(1) to save, whatever its length.

    The contract (``__rollback_append_only__``): until the step ends, the list is changed
    only by appending and by overwriting items from its last one at the save on (V0's
    copy-on-write replaces a table's last block id in place); it never shrinks below its
    saved length and no item before the last is written. A list taken out of the field
    whole and replaced (a swap, a free) is fine: the old list is left as it was. So its
    length and its last item put it back exactly: truncate, then restore the last."""

    __slots__ = ("obj", "length", "last")

    def __init__(self, obj: list) -> None:
        self.obj, self.length = obj, len(obj)
        self.last = obj[-1] if obj else None

    def put_back(self) -> list:
        obj = self.obj
        del obj[self.length:]
        if self.length:
            obj[-1] = self.last
        return obj

    def copy(self) -> list:
        return self.obj[:self.length - 1] + [self.last] if self.length else []

    def view(self) -> AppendedView:
        return AppendedView(self.obj, self.length, self.last)


class AppendedView(Sequence):
    """A list saved by length (:class:`_Appended`) as it was at the save, read in place: no
    copy, O(1) per item. Valid while the step lasts (the contract keeps the items before the
    saved last one unchanged); for readers of one step's start, such as
    ``engine/rollback.blocks_at_risk``."""

    __slots__ = ("_obj", "_length", "_last")

    def __init__(self, obj: list, length: int, last: Any) -> None:
        self._obj, self._length, self._last = obj, length, last

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i: int) -> Any:    # an int index only (a slice would be a copy)
        if not isinstance(i, int):
            raise TypeError(f"an AppendedView takes an int index, got {type(i).__name__}")
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"index must be in [-{self._length}, {self._length}), got {i}")
        return self._last if i == self._length - 1 else self._obj[i]


class _Layout(NamedTuple):
    """How to read one class's fields, worked out once per class."""
    slots: tuple[str, ...]
    get_slots: Callable[[object], tuple]     # all slots at once (C speed), as a tuple
    has_dict: bool
    skip: tuple[str, ...]
    appended: tuple[str, ...]


_LAYOUTS: dict[type, _Layout] = {}
_CONTAINER_TYPES = frozenset(_CONTAINERS)


def _layout(cls: type) -> _Layout:
    layout = _LAYOUTS.get(cls)
    if layout is None:                   # every slot of cls and its bases, skips left out
        slots = tuple(n for k in cls.__mro__
                      for n in ((k.__dict__.get("__slots__", ()),)
                                if isinstance(k.__dict__.get("__slots__", ()), str)
                                else k.__dict__.get("__slots__", ()))
                      if n not in ("__dict__", "__weakref__")
                      and n not in getattr(cls, "__rollback_skip__", ()))
        get = operator.attrgetter(*slots) if len(slots) > 1 else \
            (lambda obj, g=operator.attrgetter(*slots): (g(obj),)) if slots else \
            (lambda obj: ())
        layout = _LAYOUTS[cls] = _Layout(
            slots, get, any("__dict__" in k.__dict__ for k in cls.__mro__[:-1]),
            tuple(getattr(cls, "__rollback_skip__", ())),
            tuple(getattr(cls, "__rollback_append_only__", ())))
    return layout


_UNSET = object()


def save_fields(obj: object) -> tuple | dict[str, Any]:
    """The fields of ``obj`` as :func:`load_fields` needs them to put ``obj`` back: for an
    object of slots whose fields hold no container, just the tuple of their values (the
    common case of many small objects: blocks, tree nodes); else a dict by name."""
    layout = _layout(type(obj))
    if not layout.has_dict:
        try:
            values = layout.get_slots(obj)
        except AttributeError:                       # a slot never set
            values = tuple(getattr(obj, n, _UNSET) for n in layout.slots)
        if _CONTAINER_TYPES.isdisjoint(map(type, values)):
            return values
        fields = dict(zip(layout.slots, values, strict=True))
    else:
        fields = obj.__dict__.copy()
        if layout.slots:
            fields.update({name: getattr(obj, name, _UNSET) for name in layout.slots})
        for name in layout.skip:
            fields.pop(name, None)
    appended = layout.appended
    for name, value in fields.items():
        if type(value) in _CONTAINER_TYPES:
            fields[name] = _Appended(value) if name in appended else _Saved(value)
    return fields


def load_fields(obj: object, fields: tuple | dict[str, Any]) -> None:
    """Put ``obj``'s fields back as :func:`save_fields` found them: containers refilled in
    place, a field added since removed."""
    layout = _layout(type(obj))
    if type(fields) is tuple:
        fields = dict(zip(layout.slots, fields, strict=True))
    if layout.has_dict:
        for name in [n for n in vars(obj) if n not in fields and n not in layout.skip]:
            delattr(obj, name)
    for name, value in fields.items():
        if value is _UNSET:
            if hasattr(obj, name):
                delattr(obj, name)
        else:
            setattr(obj, name, _put_back(value))


class Checkpoint:
    """What one step changed, ready to be put back: touched objects' fields and the undo
    logs of watched structures. Used once: ``commit()`` or ``rollback()``, then closed."""

    def __init__(self) -> None:
        self._fields: dict[int, tuple[object, tuple | dict]] = {}   # id -> (obj, first save)
        self._order: list[object] = []           # touched objects, in the order first touched
        self._undo: list[Callable[[], None]] = []
        # save_items: id(container) -> (container, {key: its first saved value})
        self._items: dict[int, tuple[Any, dict]] = {}
        # save_stack: id(stack) -> [stack, least length in the step, items cut below it]
        self._stacks: dict[int, list] = {}
        self.closed = self.rolled_back = False

    def touch(self, *objs: object) -> None:
        """Save each object's fields unless this checkpoint saved them already (call it
        before the object first changes in the step)."""
        self._open()
        fields = self._fields
        for obj in objs:
            if id(obj) not in fields:
                fields[id(obj)] = (obj, save_fields(obj))
                self._order.append(obj)

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` if the step is rolled back (last registered, first run): for a change
        cheaper to undo than to save a copy for, such as taking one entry out of a map of
        every request."""
        self._open()
        self._undo.append(undo)

    def save_items(self, container: Any, keys: Iterable[Hashable]) -> None:
        """Before ``container[key]`` changes for each of ``keys`` (a list's or a bytearray's
        indexes, a dict's keys): keep what it holds now (a dict's missing key: its absence; a
        container in it: a copy), unless this checkpoint kept that item already; the rollback
        puts each item back. For a container too large to copy each step of which a step
        changes a few items: O(keys), whatever its size."""
        self._open()
        entry = self._items.get(id(container))
        if entry is None:
            entry = self._items[id(container)] = (container, {})
        saved = entry[1]
        if type(container) is dict:
            for key in keys:
                if key not in saved:
                    saved[key] = _save(container.get(key, _UNSET))
        else:
            for key in keys:
                if key not in saved:
                    saved[key] = container[key]

    def item_at_start(self, container: Any, key: Hashable) -> Any:
        """``container[key]`` as it was when this checkpoint first kept it
        (:meth:`save_items`), else as it is now (``KeyError``: a dict's key absent then)."""
        entry = self._items.get(id(container))
        if entry is None or key not in entry[1]:
            return container[key]
        value = entry[1][key]
        if value is _UNSET:
            raise KeyError(key)
        return _copy(value)

    def save_stack(self, stack: list, cut_to: int | None = None) -> None:
        """Save a stack, a list a step changes only at its end (pops, pushes), in O(what it
        pops). The first call, before any change, records its length; call it again before
        each cut of the stack to its first ``cut_to`` items (a pop: ``len(stack) - 1``): the
        items the cut takes from below the least length the stack had are kept (above that
        length it holds only what the step pushed). The rollback cuts it back to that least
        length and pushes the kept items back. A push needs no call."""
        self._open()
        entry = self._stacks.get(id(stack))
        if entry is None:
            entry = self._stacks[id(stack)] = [stack, len(stack), []]
        if cut_to is not None and cut_to < entry[1]:
            entry[2].extend(reversed(stack[cut_to:entry[1]]))
            entry[1] = cut_to

    def watch(self, queue: Any) -> None:
        """Log the moves of ``queue`` from now on: ``queue.begin_log()`` now, then
        ``queue.undo(log)`` on rollback (the next step's ``begin_log`` replaces the log)."""
        self._open()
        log = queue.begin_log()
        self._undo.append(lambda: queue.undo(log))

    def saved(self, obj: object, name: str) -> Any:
        """Field ``name`` of ``obj`` as it was when first touched (``KeyError``: never
        touched); a saved container comes back as a copy of its items at that time."""
        return _copy(self._saved_field(obj, name))

    def _saved_field(self, obj: object, name: str) -> Any:
        """What was saved of field ``name`` of ``obj`` (``KeyError``: never touched)."""
        fields = self._fields[id(obj)][1]
        if type(fields) is tuple:
            fields = dict(zip(_layout(type(obj)).slots, fields, strict=True))
        return fields[name]

    def saved_view(self, obj: object, name: str) -> Any:
        """Field ``name`` of ``obj`` as it was when first touched, without a copy (``KeyError``:
        never touched): a list saved by length as an :class:`AppendedView`, another saved
        container as the checkpoint's own copy of its items (read it, never change it: the
        rollback puts it back), anything else as it is. For a reader of the step's start
        that needs a few items, where :meth:`saved` would copy the whole container."""
        value = self._saved_field(obj, name)
        if type(value) is _Appended:
            return value.view()
        if type(value) is _Saved and not value.nested:
            return value.items
        return _copy(value)

    def at_start(self, obj: object, name: str) -> Any:
        """Field ``name`` of ``obj`` as it was when the step began: its saved value if the
        step touched it, else its value now (an object is touched before it first changes)."""
        return self.saved(obj, name) if id(obj) in self._fields else getattr(obj, name)

    def commit(self) -> None:
        """The step succeeded: forget what was saved (the watched queues' logs are dropped
        with it: each step begins its own)."""
        if self.closed:
            raise RuntimeError("this checkpoint was already committed or rolled back")
        self.closed = True
        self._fields, self._order, self._undo, self._items, self._stacks = {}, [], [], {}, {}

    def rollback(self) -> None:
        """Put every touched object and watched structure back as it was, then close. The
        undo logs run first, last entry first; then the saved items and stacks are put back
        (each to its first save: their order does not matter); then each object gets its
        first saved fields back, the last touched first, so that a container two objects
        share ends as the earlier save found it. Resumable: each entry is dropped only once
        it is done, so if one raises, calling ``rollback()`` again goes on from there; once
        done, calling it again does nothing (a committed checkpoint still refuses)."""
        if self.rolled_back:
            return
        if self.closed:
            raise RuntimeError("this checkpoint was already committed or rolled back")
        undo, order, fields = self._undo, self._order, self._fields
        while undo:
            undo[-1]()
            undo.pop()
        while self._items:
            container, saved = next(iter(self._items.values()))
            for key, value in saved.items():
                if value is _UNSET:
                    container.pop(key, None)
                else:
                    container[key] = _put_back(value)
            del self._items[id(container)]
        for stack, least, cut in self._stacks.values():
            stack[least:] = cut[::-1]
        self._stacks = {}
        while order:
            load_fields(order[-1], fields[id(order[-1])][1])
            order.pop()
        self.closed = self.rolled_back = True
        self._fields = {}

    def _open(self) -> None:
        if self.closed:
            raise RuntimeError("this checkpoint was already committed or rolled back")
