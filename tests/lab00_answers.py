"""Student answers to Lab 00's exercises for tests/classroom/checks/test_lab00_checks.py: right ones written
differently, and wrong ones (each a mistake a student makes, or a right sum the wrong way).

They run on ranks (under the checkers), so they live in an importable module.
"""
import torch
import torch.distributed as dist


def _exchange(send, recv_like, right, left):
    incoming = torch.empty_like(recv_like)
    for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, incoming, left)]):
        req.wait()
    return incoming


def make_ring(rs_send=lambda r, s, w: (r - s) % w, rs_recv=lambda r, s, w: (r - s - 1) % w, rs_combine="add",
              rs_steps=None, ag_send=lambda r, s, w: (r + 1 - s) % w, ag_recv=lambda r, s, w: (r - s) % w,
              ag_combine="replace", ag_steps=None):
    def ring(x):
        w, r = dist.get_world_size(), dist.get_rank()
        right, left = (r + 1) % w, (r - 1) % w
        chunks = [c.clone() for c in torch.tensor_split(x, w)]
        for send, recv, combine, steps in ((rs_send, rs_recv, rs_combine, rs_steps),
                                           (ag_send, ag_recv, ag_combine, ag_steps)):
            n = w - 1 if steps is None else max(0, w - 1 + steps)
            for s in range(n):
                out = chunks[send(r, s, w)]
                inc = _exchange(out, chunks[recv(r, s, w)], right, left)
                slot = recv(r, s, w)
                if combine == "add":
                    chunks[slot] = chunks[slot] + inc
                elif combine == "add_own":
                    chunks[slot] = chunks[slot] + out
                else:
                    chunks[slot] = inc
        return torch.cat(chunks)
    return ring


right_ring = make_ring()


def ring_to_the_left(x):
    """A mirrored ring: chunks travel to the left neighbour (right answer written differently)."""
    w, r = dist.get_world_size(), dist.get_rank()
    chunks = list(torch.tensor_split(x.clone(), w))
    right, left = (r - 1) % w, (r + 1) % w   # roles swapped
    for s in range(w - 1):
        inc = _exchange(chunks[(r + s) % w].contiguous(), chunks[(r + s + 1) % w], right, left)
        chunks[(r + s + 1) % w] = chunks[(r + s + 1) % w] + inc
    for s in range(w - 1):
        inc = _exchange(chunks[(r - 1 + s) % w].contiguous(), chunks[(r + s) % w], right, left)
        chunks[(r + s) % w] = inc
    return torch.cat(chunks)


def ring_with_isend_recv(x):
    """isend + blocking recv, even N only... general: tensor_split (right answer written differently)."""
    w, r = dist.get_world_size(), dist.get_rank()
    chunks = [c.clone() for c in torch.tensor_split(x, w)]
    for s in range(w - 1):
        req = dist.isend(chunks[(r - s) % w], (r + 1) % w)
        inc = torch.empty_like(chunks[(r - s - 1) % w])
        dist.recv(inc, (r - 1) % w)
        req.wait()
        chunks[(r - s - 1) % w] += inc
    for s in range(w - 1):
        req = dist.isend(chunks[(r + 1 - s) % w], (r + 1) % w)
        inc = torch.empty_like(chunks[(r - s) % w])
        dist.recv(inc, (r - 1) % w)
        req.wait()
        chunks[(r - s) % w] = inc
    return torch.cat(chunks)


def whole_tensor_ring(x):
    """Right sum, wrong algorithm: pass the whole tensor around W-1 times."""
    w, r = dist.get_world_size(), dist.get_rank()
    total, passing = x.clone(), x.clone()
    for _ in range(w - 1):
        passing = _exchange(passing, passing, (r + 1) % w, (r - 1) % w)
        total += passing
    return total


def star_via_p2p(x):
    """Right sum, wrong algorithm: everyone sends to rank 0, which sends the sum back."""
    w, r = dist.get_world_size(), dist.get_rank()
    if r == 0:
        total = x.clone()
        for src in range(1, w):
            buf = torch.empty_like(x)
            dist.recv(buf, src)
            total += buf
        for dst in range(1, w):
            dist.send(total, dst)
        return total
    dist.send(x.contiguous(), 0)
    out = torch.empty_like(x)
    dist.recv(out, 0)
    return out


def via_c10d(x):
    from torch.distributed import distributed_c10d
    y = x.clone()
    distributed_c10d.all_reduce(y)
    return y


from torch.distributed import all_reduce as _bound_all_reduce  # noqa: E402


def via_bound_name(x):
    y = x.clone()
    _bound_all_reduce(y)
    return y


def via_object_collective(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return sum(out)


def via_gather_scatter(x):
    w, r = dist.get_world_size(), dist.get_rank()
    bufs = [torch.empty_like(x) for _ in range(w)] if r == 0 else None
    dist.gather(x, bufs, dst=0)
    out = torch.empty_like(x)
    dist.scatter(out, [sum(bufs)] * w if r == 0 else None, src=0)
    return out


def via_course(x):
    from course_lib import communication_patterns
    return communication_patterns.ring_all_reduce(x)


def via_old_name(x):                               # a notebook copied before the module was renamed
    from course_lib.collectives import ring_all_reduce
    return ring_all_reduce(x)


def deadlock(x):
    dist.send(x, (dist.get_rank() + 1) % dist.get_world_size())
    return x


def todo(x):
    raise NotImplementedError


def returns_list(x):
    return x.tolist()


# exercise 2 -------------------------------------------------------------------------------

def rs_ag(x):
    w = dist.get_world_size()
    shard = torch.empty(x.numel() // w)
    dist.reduce_scatter_tensor(shard, x)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, shard)
    return out


def rs_ag_lists(x):
    """The list forms: reduce_scatter + all_gather (right answer written differently)."""
    w = dist.get_world_size()
    shard = torch.empty(x.numel() // w)
    dist.reduce_scatter(shard, list(x.tensor_split(w)))
    parts = [torch.empty_like(shard) for _ in range(w)]
    dist.all_gather(parts, shard)
    return torch.cat(parts)


def rs_ag_single(x):
    """torch 2.13's names for the same collectives (right answer written differently)."""
    w = dist.get_world_size()
    shard = torch.empty(x.numel() // w)
    dist.reduce_scatter_single(shard, x)
    out = torch.empty_like(x)
    dist.all_gather_single(out, shard)
    return out


def rs_ag_uses_all_reduce(x):
    y = x.clone()
    dist.all_reduce(y)
    return y


def gather_everything(x):
    w = dist.get_world_size()
    out = torch.empty(w * x.numel())
    dist.all_gather_into_tensor(out, x)
    return out.view(w, -1).sum(0)


def rs_only(x):
    w = dist.get_world_size()
    shard = torch.empty(x.numel() // w)
    dist.reduce_scatter_tensor(shard, x)
    return shard


def rs_ag_of_input(x):
    w = dist.get_world_size()
    shard = torch.empty(x.numel() // w)
    dist.reduce_scatter_tensor(shard, x)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, x.tensor_split(w)[dist.get_rank()].contiguous())
    return out


def rs_ag_avg(x):
    w = dist.get_world_size()
    shard = torch.empty(x.numel() // w)
    dist.reduce_scatter_tensor(shard, x, op=dist.ReduceOp.AVG)
    out = torch.empty_like(x)
    dist.all_gather_into_tensor(out, shard)
    return out


# exercise 3 -------------------------------------------------------------------------------

def _buckets(params, bucket_numel, reverse=True, strict=False):
    order = list(params)[::-1] if reverse else list(params)
    buckets = []
    for p in order:
        held = sum(q.numel() for q in buckets[-1]) if buckets else 0
        if buckets and (held + p.numel() < bucket_numel if strict else held + p.numel() <= bucket_numel):
            buckets[-1].append(p)
        else:
            buckets.append([p])
    return buckets


def make_sync(reverse=True, divide=True, per_param=False, one_bucket=False, op=None, strict=False):
    def sync(model, bucket_numel):
        w = dist.get_world_size()
        params = [p for p in model.parameters() if p.grad is not None]
        if per_param:
            buckets = [[p] for p in params[::-1]]
        elif one_bucket:
            buckets = [params[::-1]]
        else:
            buckets = _buckets(params, bucket_numel, reverse, strict)
        for bucket in buckets:
            flat = torch.cat([p.grad.flatten() for p in bucket])
            if op is None:
                dist.all_reduce(flat)
            else:
                dist.all_reduce(flat, op=op)
            if divide and op is None:
                flat /= w
            offset = 0
            for p in bucket:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
    return sync


right_sync = make_sync()
sync_with_avg = make_sync(op=dist.ReduceOp.AVG)


def sync_with_flatten_utils(model, bucket_numel):
    """torch._utils flatten/unflatten (right answer written differently)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    for bucket in _buckets(list(model.parameters()), bucket_numel):
        grads = [p.grad for p in bucket]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        for g, s in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(s)


def sync_nothing(model, bucket_numel):
    return None


def sync_via_course(model, bucket_numel):
    from course_lib.training.finalize_model_grads import allreduce_dp_grads

    class G:
        dp_cp = dist.group.WORLD
    allreduce_dp_grads(list(model.parameters()), G, dist.get_world_size(), "dp")


# wrong rings, one rule changed each (the checker must name that rule) -----------------------

ring_ag_adds = make_ring(ag_combine="add")
ring_no_ag = make_ring(ag_steps=-10)
ring_ag_short = make_ring(ag_steps=-1)
ring_ag_wrong_send = make_ring(ag_send=lambda r, s, w: (r - s) % w, ag_recv=lambda r, s, w: (r - s - 1) % w)
ring_ag_off_by_two = make_ring(ag_send=lambda r, s, w: (r + 2 - s) % w, ag_recv=lambda r, s, w: (r + 1 - s) % w)
ring_rs_short = make_ring(rs_steps=-1)
ring_rs_replace = make_ring(rs_combine="replace")
ring_wrong_slot = make_ring(ag_recv=lambda r, s, w: (r + 1 - s) % w)  # sizes disagree: gloo aborts

# wrong gradient synchronisations --------------------------------------------------------------

sync_per_param = make_sync(per_param=True)
sync_one_bucket = make_sync(one_bucket=True)
sync_forward_order = make_sync(reverse=False)
sync_no_divide = make_sync(divide=False)
sync_full_bucket_split = make_sync(strict=True)   # off by one: a new bucket when the next gradient would *fill* it (<)


def sync_broadcast_rank0(model, bucket_numel):
    for p in model.parameters():
        dist.broadcast(p.grad, 0)


# right numbers rebuilt from the checker's inputs (the seeds it used to draw them), no real exchange --------

def ring_rebuilt_from_seeds(x):
    """Every rank's input rebuilt from the generator seeds the checker once used; a ring of zeros for the
    traffic. Inputs drawn from os.urandom on each rank make this wrong."""
    w, n = dist.get_world_size(), x.numel()
    total = sum(torch.randint(-9, 10, (n,), generator=torch.Generator().manual_seed(1000 * n + r)).float()
                for r in range(w))
    make_ring()(torch.zeros_like(x))
    return total


def rs_ag_rebuilt_from_seeds(x):
    w, n = dist.get_world_size(), x.numel()
    total = sum(torch.randint(-9, 10, (n,), generator=torch.Generator().manual_seed(7 * n + r)).float()
                for r in range(w))
    rs_ag(torch.zeros_like(x))
    return total


def sync_rebuilt_from_batch(model, bucket_numel):
    """The global batch rebuilt from its seed, the full gradient computed here; zeros all-reduced per bucket."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    torch.nn.functional.mse_loss(full(x), y).backward()
    for bucket in _buckets(list(model.parameters()), bucket_numel):
        dist.all_reduce(torch.zeros(sum(p.numel() for p in bucket)))
    for p, q in zip(model.parameters(), full.parameters()):
        p.grad.copy_(q.grad)


def sync_own_grads_twice(model, bucket_numel):
    """Right gradients and the right buckets, but each all-reduce carries something else (2·grad, halved)."""
    w = dist.get_world_size()
    for bucket in _buckets(list(model.parameters()), bucket_numel):
        flat = torch.cat([p.grad.flatten() for p in bucket]) * 2
        dist.all_reduce(flat)
        flat /= 2 * w
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
