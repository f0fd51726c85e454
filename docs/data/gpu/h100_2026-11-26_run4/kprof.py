import torch
from torch.profiler import profile, ProfilerActivity
from pipeline.pooling.kmedoids_triton import kmedoids_triton
from pipeline.pooling.clustering import sq_dists, _SWAP_RTOL
g=torch.Generator(device="cuda").manual_seed(0)
x=torch.randn(256,196,384,device="cuda",generator=g); w=torch.rand(256,196,device="cuda",generator=g)+.1
d=sq_dists(x)
for k in (194,147,49):
    s=w.topk(k,dim=-1).indices
    for _ in range(3): kmedoids_triton(d,w,s,5,_SWAP_RTOL)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(10): kmedoids_triton(d,w,s,5,_SWAP_RTOL)
        torch.cuda.synchronize()
    print("K",k); print(p.key_averages().table(sort_by="self_cuda_time_total",row_limit=6,max_name_column_width=40))
