"""Device time of a call as a decode graph runs it, for the benches that time one kernel or op."""

import torch


def graph_us(fn, calls: int, replays: int) -> float:
    """Median microseconds per call of ``fn`` captured ``calls`` times back to back in one CUDA graph
    (compiled by one eager call first), over ``replays`` replays: no launch overhead, the gaps between
    the graph's kernels included."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]
