"""Work sharing inside one parallel loop: each thread claims tasks from its own contiguous share,
then from the others' shares once its own is done.

Numba's parallel loops split their iterations statically: a loop ends when its slowest thread
does, and on a shared machine one core is often slower for a while (the memory bus is shared
with other tenants). A decode step runs ~150 short loops on the default model, so it paid that
wait ~150 times a token. Here a thread that finishes early takes the next unstarted task of
another share, with one atomic add per task; each share is still read front to back, so each
thread's stream of weight rows stays sequential for the prefetchers.

    start_claims(claims, n_tasks, threads)         # serially, before the loop
    for t in prange(threads):
        task = claim(claims, t, threads)
        while task >= 0:
            ...                                      # run task
            task = claim(claims, t, threads)

Every task runs exactly once, however prange spreads its `threads` iterations over threads.
Which thread runs a task never changes a result: tasks write disjoint outputs.
"""

from numba import njit, types
from numba.extending import intrinsic

from .vector_ir import I64, as_i64


@intrinsic
def _fetch_add(typingctx, arr, i):
    """arr[i] += 1 atomically; returns the value before (arr: 1-D int64)."""
    sig = types.int64(arr, i)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.gep(data, [as_i64(builder, args[1], None)])
        return builder.atomic_rmw("add", ptr, I64(1), "monotonic")

    return sig, codegen


@njit(cache=True, _nrt=False)
def start_claims(claims, n_tasks, threads):
    """Share n_tasks among `threads`: claims[0, t] is share t's next task, claims[1, t] its end."""
    for t in range(threads):
        claims[0, t] = n_tasks * t // threads
        claims[1, t] = n_tasks * (t + 1) // threads


@njit(cache=True, _nrt=False)
def claim(claims, t, threads):
    """The next task for thread t: from its own share, else from the next share with tasks left;
    -1 when none is left anywhere."""
    for i in range(threads):
        u = (t + i) % threads
        task = _fetch_add(claims[0], u)
        if task < claims[1, u]:
            return task
    return -1
