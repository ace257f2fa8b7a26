"""One parallel region per call: a team of native threads runs every kernel of the call in turn.

The team is the process's pool of waiting workers (:mod:`rlx.codegen.pool`) plus the calling
thread, or, once ``rlx.torch`` shares torch's threads, an OpenMP region of torch's runtime.
When another Python thread's call holds the pool, the entry function starts its own
``threads - 1`` pthreads for the call and joins them after. Every member runs the same step
list (``team``): for each kernel it takes the next item from that kernel's atomic counter until
none is left, then waits at a barrier (the pool's: a short spin, then sleep; see
``rlx_pool_barrier``), so the next kernel sees all of this one's results. A *serial* step (the
embedding scatter-add and its zeroing) runs on member 0 while the others wait in the barrier.
Every item is computed by exactly one thread with the same code, so results do not depend on
which thread ran it: the output is bit-identical for any thread count. The barrier is sized
for the members a call really got (a thread that could not be created, an OpenMP region with
fewer threads than asked), and they take the others' share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llvmlite import ir

from rlx.codegen.irutil import I8, I32, I64, PTR, VOID, alloca_entry, as_i64, declare, for_range, gep, i32, i64
from rlx.codegen.pool import BARRIER_MEMBERS, BARRIER_WORDS, declare_barrier, declare_pool

# Shared by the members: step arguments, counters, scratch, its stride, barrier, start flag, profile,
# and each step's item count (for steps whose count only a call knows: symbolic dimensions).
_SHARED = ir.LiteralStructType([PTR, PTR, PTR, I64, PTR, PTR, PTR, PTR])
_THREAD_ARG = ir.LiteralStructType([PTR, I64])


@dataclass(frozen=True)
class Step:
    """One kernel of the call: ``item_fn(args, item, scratch)`` over ``items`` items, ``args``
    the call's argument array (:class:`Arguments`) from slot ``first_slot`` on."""

    item_fn: ir.Function
    first_slot: int
    items: int | ir.Value  # an i64 of the entry function when it depends on the call's sizes
    serial: bool = False  # run by member 0 alone, as one item


@dataclass
class Arguments:
    """The pointers every step of a call passes its kernel, one array for the call, filled in
    the entry function from tables: most pointers are a base (the arena, a buffer's address, a
    constant's data) plus a byte offset, so a slot is a base's number and an offset, and one
    loop fills them all. Written slot by slot, a graph of a thousand kernels made the entry
    function tens of thousands of lines. :meth:`at` makes such a pointer; any other value a
    step passes is stored as it is."""

    pointers: list[ir.Value] = field(default_factory=list)
    # id of a pointer made by at() -> (the pointer, its base, its byte offset): the pointer is
    # held, so no id is reused while it is in the table
    _sources: dict[int, tuple[ir.Value, ir.Value, int]] = field(default_factory=dict)

    def at(self, b: ir.IRBuilder, base: ir.Value, offset: int = 0, name: str = "") -> ir.Value:
        """``base + offset`` bytes (``base`` itself at 0), remembered as a base and an offset;
        ``base`` may be such a pointer itself."""
        source = self._sources.get(id(base))
        root, start = (source[1], source[2]) if source is not None else (base, 0)
        pointer = gep(b, base, [i64(offset)], I8, name) if offset else base
        self._sources[id(pointer)] = (pointer, root, start + offset)
        return pointer

    def add(self, pointers: list[ir.Value]) -> int:
        """Append one step's pointers; the slot of its first."""
        first = len(self.pointers)
        self.pointers.extend(pointers)
        return first

    def emit(self, module: ir.Module, b: ir.IRBuilder) -> ir.Value:
        """Fill the array at ``b`` (the entry function, after every pointer is made); its address."""
        array = alloca_entry(b, PTR, "steps.args", max(1, len(self.pointers)))
        roots: dict[int, int] = {}
        bases: list[ir.Value] = []
        base_of, offset_of = [], []
        direct = []
        for slot, pointer in enumerate(self.pointers):
            source = self._sources.get(id(pointer))
            if source is None:
                base_of.append(-1)
                offset_of.append(0)
                direct.append((slot, pointer))
                continue
            _, root, offset = source
            if id(root) not in roots:
                roots[id(root)] = len(bases)
                bases.append(root)
            base_of.append(roots[id(root)])
            offset_of.append(offset)
        base_table = alloca_entry(b, PTR, "steps.bases", max(1, len(bases)))
        for index, base in enumerate(bases):
            b.store(base, gep(b, base_table, [i64(index)], PTR))
        which = _constant_table(module, "args.base", I32, [i32(v) for v in base_of])
        offsets = _constant_table(module, "args.offset", I64, [i64(v) for v in offset_of])
        with for_range(b, 0, len(self.pointers), "arg") as slot:
            base_index = b.load(gep(b, which, [i64(0), slot], which.value_type), typ=I32)
            with b.if_then(b.icmp_signed(">=", base_index, i32(0))):
                base = b.load(gep(b, base_table, [b.sext(base_index, I64)], PTR), typ=PTR)
                offset = b.load(gep(b, offsets, [i64(0), slot], offsets.value_type), typ=I64)
                b.store(gep(b, base, [offset], I8), gep(b, array, [slot], PTR))
        for slot, pointer in direct:
            b.store(pointer, gep(b, array, [i64(slot)], PTR))
        return array


def share_identical_items(steps: list[Step]) -> list[Step]:
    """The steps with one item function for each distinct body: the kernels of a model's repeated
    layers lower to identical functions (an 8-layer LM: 307 functions, 56 distinct), and LLVM
    would optimise and compile every copy. Bodies compare as IR text, so only identical code is
    shared; a copy's step calls the first function of that body.

    The copy keeps its name as a one-line function that calls the one kept, so the IR still has a
    kernel function per node (``attention.7``, ``matmul.12``) for a reader to find; nothing calls
    it, and LLVM drops it before making machine code.
    """
    first: dict[str, ir.Function] = {}
    decided: dict[int, ir.Function] = {}  # by id of a function already seen: what its steps call
    shared = []
    for step in steps:
        fn = step.item_fn
        if id(fn) in decided:  # a function emitted once for several kernels
            shared.append(Step(decided[id(fn)], step.first_slot, step.items, step.serial))
            continue
        header = f"{fn.get_reference()}("
        text = str(fn)
        assert header in text, f"unexpected function header for {fn.name}"
        body = text.replace(header, "@(", 1)  # the definition's own name is all that may differ
        kept = decided[id(fn)] = first.setdefault(body, fn)
        if kept is not fn:
            forward_to(fn, kept)
        shared.append(Step(kept, step.first_slot, step.items, step.serial))
    return shared


def forward_to(copy: ir.Function, kept: ir.Function) -> None:
    """Give ``copy`` (empty, or a body equal to ``kept``'s) the body ``kept(args...)``: the name
    of a kernel whose code another function holds."""
    copy.linkage = "internal"
    copy.blocks = []
    b = ir.IRBuilder(copy.append_basic_block("same.as.kept"))
    b.call(kept, list(copy.args))
    b.ret_void()


def _field(b: ir.IRBuilder, ty: ir.LiteralStructType, ptr: ir.Value, index: int) -> ir.Value:
    return gep(b, ptr, [i32(0), i32(index)], ty)


def _load(b: ir.IRBuilder, ty: ir.LiteralStructType, ptr: ir.Value, index: int, name: str) -> ir.Value:
    return b.load(_field(b, ty, ptr, index), typ=ty.elements[index], name=name)


def emit_team(
    module: ir.Module,
    b: ir.IRBuilder,
    steps: list[Step],
    arguments: Arguments,
    threads: int,
    scratch: ir.Value,
    stride: int | ir.Value,
    profile: ir.Value | None,
    now: Callable[[ir.IRBuilder], ir.Value] | None,
    cap: ir.Value | None = None,
) -> None:
    """Emit, at ``b``, the whole parallel region of one call running ``steps`` in order.

    ``cap`` (an i64; 0: none) limits the members of this call below ``threads``: a caller that
    knows a call is too small to pay for a team asks for one thread without a second build.
    """
    team = _emit_team_main(module, steps, now if profile is not None else None)
    args_table = arguments.emit(module, b)
    counters = alloca_entry(b, I64, "steps.counters", max(1, len(steps)))
    limits = alloca_entry(b, I64, "steps.items", max(1, len(steps)))
    static_items = _constant_table(
        module, "steps.static_items", I64, [i64(step.items if isinstance(step.items, int) else 0) for step in steps]
    )
    with for_range(b, 0, len(steps), "step.init") as index:
        b.store(i64(0), gep(b, counters, [index], I64))
        items = b.load(gep(b, static_items, [i64(0), index], static_items.value_type), typ=I64)
        b.store(items, gep(b, limits, [index], I64))
    for index, step in enumerate(steps):  # the counts a call's sizes decide
        if not isinstance(step.items, int):
            b.store(step.items, gep(b, limits, [i64(index)], I64))
    barrier = alloca_entry(b, ir.ArrayType(I32, BARRIER_WORDS), "barrier")
    barrier.align = 16
    ready = alloca_entry(b, I32, "ready")
    b.store(i32(0), ready)
    shared = alloca_entry(b, _SHARED, "shared")
    values = (
        args_table,
        counters,
        scratch,
        as_i64(stride),
        barrier,
        ready,
        profile if profile is not None else ir.Constant(PTR, None),
        limits,
    )
    for index, value in enumerate(values):
        b.store(value, _field(b, _SHARED, shared, index))

    start_fn = _emit_start(module)

    def start(members: ir.Value) -> None:
        b.call(start_fn, [shared, members])

    threads, spawned = _team_size(b, steps, threads)
    if threads > 1 and cap is not None:
        capped = b.and_(b.icmp_signed(">", cap, i64(0)), b.icmp_signed("<", cap, spawned))
        spawned = b.select(capped, cap, spawned, name="members.capped")
    if threads > 1:
        acquire, run = declare_pool(module)
        pooled = b.call(acquire, [b.trunc(spawned, I32), i32(threads)], name="pooled")
        with b.if_else(b.icmp_signed("!=", pooled, i32(0))) as (from_pool, own_threads):
            with from_pool:  # the process's waiting workers, or the host's OpenMP threads (rlx.codegen.pool)
                b.call(run, [team, start_fn, shared, pooled])
            with own_threads:  # another thread's call holds the pool: start a team for this call
                _start_and_join(module, b, team, shared, threads, spawned, start)
    else:
        start(i32(1))
        b.call(team, [shared, i64(0)])


def _emit_start(module: ir.Module) -> ir.Function:
    """``start(shared, members)``: size the barrier for the members that exist, then let them run.

    Called by whoever knows how many members the call got: the entry function for its own
    threads, the pool's run function for workers, member 0 of an OpenMP region for its team.
    """
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I32]), name="team.start")
    fn.linkage = "internal"
    shared, members = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    words = _load(b, _SHARED, shared, 4, "barrier")  # the pool's team barrier: all zero but members
    for index in range(BARRIER_WORDS):
        b.store(members if index == BARRIER_MEMBERS else i32(0), gep(b, words, [i64(index)], I32))
    b.atomic_rmw("xchg", _load(b, _SHARED, shared, 5, "ready"), i32(1), "release")  # a release store
    b.ret_void()
    return fn


def _start_and_join(
    module: ir.Module,
    b: ir.IRBuilder,
    team: ir.Function,
    shared: ir.Value,
    threads: int,
    spawned: ir.Value,
    start: Callable[[ir.Value], None],
) -> None:
    """Start members 1.. with ``pthread_create``, ``start`` the ones that exist, run member 0
    here, join them."""
    create = declare(module, "pthread_create", I32, [PTR, PTR, PTR, PTR])
    join = declare(module, "pthread_join", I32, [I64, PTR])
    thread_main = _emit_thread_main(module, team)
    members = alloca_entry(b, I32, "members")
    b.store(i32(1), members)
    handles = alloca_entry(b, I64, "handles", threads)
    created = alloca_entry(b, I8, "created", threads)
    thread_args = alloca_entry(b, _THREAD_ARG, "thread.args", threads)
    with for_range(b, 1, spawned, "t") as t:
        arg = gep(b, thread_args, [t], _THREAD_ARG)
        b.store(shared, _field(b, _THREAD_ARG, arg, 0))
        b.store(t, _field(b, _THREAD_ARG, arg, 1))
        status = b.call(create, [gep(b, handles, [t], I64), ir.Constant(PTR, None), thread_main, arg])
        ok = b.icmp_signed("==", status, i32(0))
        b.store(b.zext(ok, I8), gep(b, created, [t], I8))
        b.store(b.add(b.load(members, typ=I32), b.zext(ok, I32)), members)
    start(b.load(members, typ=I32))
    b.call(team, [shared, i64(0)])
    with for_range(b, 1, spawned, "t.join") as t:
        flag = b.load(gep(b, created, [t], I8), typ=I8)
        with b.if_then(b.icmp_unsigned("!=", flag, ir.Constant(I8, 0))):
            b.call(join, [b.load(gep(b, handles, [t], I64), typ=I64), ir.Constant(PTR, None)])


def _team_size(b: ir.IRBuilder, steps: list[Step], threads: int) -> tuple[int, ir.Value]:
    """``(most members, members to start)``: no more than the widest step has items.

    A member that finds no item only costs its wake-up (from the pool) or its start and join
    (35-60 us on the benchmark host, more than a small call's whole work). With item counts
    known only per call, the count is computed at run time.
    """
    counts = [1 if step.serial else step.items for step in steps]
    if all(isinstance(count, int) for count in counts):
        most = max(1, min(threads, max((int(count) for count in counts), default=1)))
        return most, i64(most)
    widest: ir.Value = i64(1)
    for count in counts:
        value = as_i64(count)
        widest = b.select(b.icmp_signed(">", value, widest), value, widest, name="widest")
    return threads, b.select(b.icmp_signed("<", widest, i64(threads)), widest, i64(threads), name="members.wanted")


def _emit_team_main(
    module: ir.Module, steps: list[Step], now: Callable[[ir.IRBuilder], ir.Value] | None
) -> ir.Function:
    """``team(shared, tid)``: wait for the start, then every step, each followed by the barrier.

    With ``now`` (a profiling build), member 0 records each step's nanoseconds at its barrier.
    """
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64]), name="team")
    fn.linkage = "internal"
    shared, tid = fn.args
    shared.name, tid.name = "shared", "tid"
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    args_table = _load(b, _SHARED, shared, 0, "args.table")
    counters = _load(b, _SHARED, shared, 1, "counters")
    scratch = _load(b, _SHARED, shared, 2, "scratch")
    stride = _load(b, _SHARED, shared, 3, "stride")
    barrier = _load(b, _SHARED, shared, 4, "barrier")
    ready = _load(b, _SHARED, shared, 5, "ready")
    profile = _load(b, _SHARED, shared, 6, "profile")
    limits = _load(b, _SHARED, shared, 7, "limits")
    wait = declare_barrier(module)
    yield_ = declare(module, "sched_yield", I32, [])

    spin = b.append_basic_block("start.wait")
    go = b.append_basic_block("start")
    b.branch(spin)
    b.position_at_end(spin)
    started = b.load_atomic(ready, "acquire", 4, typ=I32)
    with b.if_then(b.icmp_signed("==", started, i32(0))):
        b.call(yield_, [])
    b.cbranch(b.icmp_signed("!=", started, i32(0)), go, spin)
    b.position_at_end(go)
    mine = gep(b, scratch, [b.mul(tid, stride)], I8, "my.scratch")
    is_first = b.icmp_signed("==", tid, i64(0), name="first")
    clock = alloca_entry(b, I64, "clock")
    if now is not None:
        b.store(now(b), clock)

    # The steps as data, run by one loop: the item functions' addresses and the serial flags in
    # constant tables. Emitted step by step, a graph of a thousand kernels (an unrolled loop, a
    # deep model) made this function tens of thousands of lines, each kernel inlined into it.
    functions = _constant_table(module, "steps.functions", PTR, [step.item_fn for step in steps])
    serial = _constant_table(module, "steps.serial", I8, [ir.Constant(I8, int(step.serial)) for step in steps])
    first_slots = _constant_table(module, "steps.first_slot", I64, [i64(step.first_slot) for step in steps])
    item_type = ir.FunctionType(VOID, [PTR, I64, PTR])  # item_fn(args, item, scratch)
    with for_range(b, 0, len(steps), "step") as index:
        first_slot = b.load(gep(b, first_slots, [i64(0), index], first_slots.value_type), typ=I64)
        args = gep(b, args_table, [first_slot], PTR, "args")
        item_fn = _callable(b, b.load(gep(b, functions, [i64(0), index], functions.value_type), typ=PTR), item_type)
        is_serial = b.load(gep(b, serial, [i64(0), index], serial.value_type), typ=I8, name="serial")
        with b.if_else(b.icmp_unsigned("!=", is_serial, ir.Constant(I8, 0))) as (alone, shared_items):
            with alone, b.if_then(is_first):
                b.call(item_fn, [args, i64(0), mine])
            with shared_items:
                counter = gep(b, counters, [index], I64)
                limit = b.load(gep(b, limits, [index], I64), typ=I64, name="items")
                take = b.append_basic_block("step.take")
                work = b.append_basic_block("step.work")
                done = b.append_basic_block("step.done")
                b.branch(take)
                b.position_at_end(take)
                item = b.atomic_rmw("add", counter, i64(1), "monotonic", name="item")
                b.cbranch(b.icmp_signed("<", item, limit), work, done)
                b.position_at_end(work)
                b.call(item_fn, [args, item, mine])
                b.branch(take)
                b.position_at_end(done)
        b.call(wait, [barrier])
        if now is not None:
            with b.if_then(is_first):
                t = now(b)
                b.store(b.sub(t, b.load(clock, typ=I64)), gep(b, profile, [index], I64))
                b.store(t, clock)
    b.ret_void()
    return fn


def _callable(b: ir.IRBuilder, address: ir.Value, function_type: ir.FunctionType) -> ir.Value:
    """``address`` as a pointer llvmlite can call with ``function_type`` (its IR text is still
    ``ptr``; the builder's own ``bitcast`` returns a pointer unchanged, as pointers compare equal)."""
    cast = ir.CastInstr(b.block, "bitcast", address, function_type.as_pointer(), "item.fn")
    b._insert(cast)
    return cast


def _constant_table(module: ir.Module, name: str, element: ir.Type, entries: list[ir.Constant]) -> ir.GlobalVariable:
    """An internal constant array of ``entries`` (at least one entry: LLVM has no empty tables)."""
    table_type = ir.ArrayType(element, max(1, len(entries)))
    table = ir.GlobalVariable(module, table_type, name=module.get_unique_name(name))
    table.linkage = "internal"
    table.global_constant = True
    table.initializer = ir.Constant(table_type, entries or [ir.Constant(element, None)])
    return table


def _emit_thread_main(module: ir.Module, team: ir.Function) -> ir.Function:
    """The pthread start routine: unpack the thread argument and run the team's steps."""
    fn = ir.Function(module, ir.FunctionType(PTR, [PTR]), name="team.thread")
    fn.linkage = "internal"
    (arg,) = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    shared = _load(b, _THREAD_ARG, arg, 0, "shared")
    tid = _load(b, _THREAD_ARG, arg, 1, "tid")
    b.call(team, [shared, tid])
    b.ret(ir.Constant(PTR, None))
    return fn
