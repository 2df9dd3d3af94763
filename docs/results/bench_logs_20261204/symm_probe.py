# probe: can two processes on ONE GPU use torch symmetric memory (rendezvous over a gloo group)?
import os, sys, traceback, json
import torch, torch.distributed as dist
import torch.distributed._symmetric_memory as symm
import triton, triton.language as tl

@triton.jit
def put_kernel(src_ptr, dst_addr_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    dst = tl.load(dst_addr_ptr).to(tl.pointer_type(tl.bfloat16))
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src_ptr + offs, mask=m), mask=m)

def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    res = {"rank": rank}
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.set_device(0)
    for name in ("is_nvshmem_available",):
        f = getattr(symm, name, None)
        try: res[name] = f() if f else "missing"
        except Exception as e: res[name] = repr(e)
    try: res["backend"] = symm.get_backend(torch.device("cuda"))
    except Exception as e: res["backend"] = repr(e)
    try:
        t = symm.empty(4096, dtype=torch.bfloat16, device="cuda")
        hdl = symm.rendezvous(t, dist.group.WORLD.group_name)
        res["rendezvous"] = "ok"
        res["buffer_ptrs"] = [hex(p) for p in hdl.buffer_ptrs]
        t.fill_(-1); torch.cuda.synchronize(); dist.barrier()
        peer = (rank + 1) % world
        src = torch.full((4096,), float(rank + 1), dtype=torch.bfloat16, device="cuda")
        addr = torch.tensor([hdl.buffer_ptrs[peer]], dtype=torch.int64, device="cuda")
        put_kernel[(4,)](src, addr, 4096, BLOCK=1024)
        torch.cuda.synchronize()
        try:
            hdl.barrier(channel=0); res["device_barrier"] = "ok"
        except Exception as e:
            res["device_barrier"] = repr(e)[:300]
        torch.cuda.synchronize(); dist.barrier()
        src_rank = (rank - 1) % world
        res["triton_put_ok"] = bool((t == float(src_rank + 1)).all().item())
        # get_buffer view of the peer
        pv = hdl.get_buffer(peer, (4096,), torch.bfloat16)
        pv.fill_(100 + rank); torch.cuda.synchronize(); dist.barrier()
        res["get_buffer_ok"] = bool((t == 100 + src_rank).all().item())
        res["signal_pad_ptrs"] = len(hdl.signal_pad_ptrs)
    except Exception as e:
        res["error"] = traceback.format_exc()[-1500:]
    print("RESULT", json.dumps(res), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
