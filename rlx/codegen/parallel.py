"""A parallel-for emitted into the module: native threads, no Python in the loop.

``parallel_for(args, n_items, scratch, scratch_stride)`` starts ``threads - 1`` pthreads and
works on the calling thread too; each thread takes the next item from an atomic counter and
calls ``item_fn(args, item, its_scratch)``. Every item is computed by exactly one thread with
the same code, so results do not depend on which thread ran it: the output is bit-identical for
any thread count. If a thread cannot be created, the others take its share.
"""

from __future__ import annotations

from llvmlite import ir

from rlx.codegen.irutil import I8, I32, I64, PTR, VOID, alloca_entry, declare, for_range, gep, i32, i64

# Shared by all threads of one region: item arguments, item count, counter, scratch, its stride.
_SHARED = ir.LiteralStructType([PTR, I64, PTR, PTR, I64])
# What one pthread receives: the shared block and its thread index.
_THREAD_ARG = ir.LiteralStructType([PTR, I64])


def _field(builder: ir.IRBuilder, ty: ir.LiteralStructType, ptr: ir.Value, index: int, name: str) -> ir.Value:
    return gep(builder, ptr, [i32(0), i32(index)], ty, name)


def _load_field(builder: ir.IRBuilder, ty: ir.LiteralStructType, ptr: ir.Value, index: int, name: str) -> ir.Value:
    return builder.load(_field(builder, ty, ptr, index, f"{name}.ptr"), name=name, typ=ty.elements[index])


def emit_parallel_for(module: ir.Module, item_fn: ir.Function, threads: int) -> ir.Function:
    """Define ``void <item_fn>.parallel(ptr args, i64 n, ptr scratch, i64 stride)`` for ``item_fn``."""
    base = item_fn.name
    worker = _emit_worker(module, item_fn, f"{base}.worker")
    thread_main = _emit_thread_main(module, worker, f"{base}.thread")

    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64, PTR, I64]), name=f"{base}.parallel")
    fn.linkage = "internal"
    args, n_items, scratch, stride = fn.args
    for arg, name in zip(fn.args, ("args", "n", "scratch", "stride"), strict=True):
        arg.name = name
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    counter = alloca_entry(b, I64, "counter")
    b.store(i64(0), counter)
    shared = alloca_entry(b, _SHARED, "shared")
    for index, value in enumerate((args, n_items, counter, scratch, stride)):
        b.store(value, _field(b, _SHARED, shared, index, f"shared.{index}"))

    if threads > 1:
        create = declare(module, "pthread_create", I32, [PTR, PTR, PTR, PTR])
        join = declare(module, "pthread_join", I32, [I64, PTR])
        handles = alloca_entry(b, I64, "handles", threads)
        created = alloca_entry(b, I8, "created", threads)
        thread_args = alloca_entry(b, _THREAD_ARG, "thread.args", threads)
        spawn = b.select(b.icmp_signed("<", n_items, i64(threads)), n_items, i64(threads), name="spawn")
        with for_range(b, 1, spawn, "t") as t:
            arg = gep(b, thread_args, [t], _THREAD_ARG, "arg")
            b.store(shared, _field(b, _THREAD_ARG, arg, 0, "arg.shared"))
            b.store(t, _field(b, _THREAD_ARG, arg, 1, "arg.tid"))
            handle = gep(b, handles, [t], I64, "handle")
            status = b.call(create, [handle, ir.Constant(PTR, None), thread_main, arg], name="status")
            ok = b.zext(b.icmp_signed("==", status, i32(0)), I8)
            b.store(ok, gep(b, created, [t], I8))
        b.call(worker, [shared, i64(0)])
        with for_range(b, 1, spawn, "t.join") as t:
            flag = b.load(gep(b, created, [t], I8), typ=I8)
            with b.if_then(b.icmp_unsigned("!=", flag, ir.Constant(I8, 0))):
                handle = b.load(gep(b, handles, [t], I64), typ=I64, name="handle")
                b.call(join, [handle, ir.Constant(PTR, None)])
    else:
        b.call(worker, [shared, i64(0)])
    b.ret_void()
    return fn


def _emit_worker(module: ir.Module, item_fn: ir.Function, name: str) -> ir.Function:
    """``worker(shared, tid)``: take items from the counter until none are left."""
    fn = ir.Function(module, ir.FunctionType(VOID, [PTR, I64]), name=name)
    fn.linkage = "internal"
    shared, tid = fn.args
    shared.name, tid.name = "shared", "tid"
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    args = _load_field(b, _SHARED, shared, 0, "args")
    n_items = _load_field(b, _SHARED, shared, 1, "n")
    counter = _load_field(b, _SHARED, shared, 2, "counter")
    scratch = _load_field(b, _SHARED, shared, 3, "scratch")
    stride = _load_field(b, _SHARED, shared, 4, "stride")
    mine = gep(b, scratch, [b.mul(tid, stride)], I8, "my.scratch")
    loop = b.append_basic_block("take")
    work = b.append_basic_block("work")
    done = b.append_basic_block("done")
    b.branch(loop)
    b.position_at_end(loop)
    item = b.atomic_rmw("add", counter, i64(1), "monotonic", name="item")
    b.cbranch(b.icmp_signed("<", item, n_items), work, done)
    b.position_at_end(work)
    b.call(item_fn, [args, item, mine])
    b.branch(loop)
    b.position_at_end(done)
    b.ret_void()
    return fn


def _emit_thread_main(module: ir.Module, worker: ir.Function, name: str) -> ir.Function:
    """The pthread start routine: unpack the thread argument and run the worker."""
    fn = ir.Function(module, ir.FunctionType(PTR, [PTR]), name=name)
    fn.linkage = "internal"
    (arg,) = fn.args
    arg.name = "arg"
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    shared = _load_field(b, _THREAD_ARG, arg, 0, "shared")
    tid = _load_field(b, _THREAD_ARG, arg, 1, "tid")
    b.call(worker, [shared, tid])
    b.ret(ir.Constant(PTR, None))
    return fn
