"""Small calls, one build against another: two source trees (each built in place), one child
process per tree and round, 3 rounds alternating (order swapped each round), pinned to core 1;
each cell is the median over rounds of the min of 7 timeit repeats. Prints a markdown table with
head / base per call (bench/results/calls-plans.md).

    python -m bench.calls_ab BASE_TREE HEAD_TREE
"""
import json, statistics, subprocess, sys, os
CHILD = r'''
import timeit, json, numpy as np, cpufuse
from cpufuse.reference.quant import make_weight
rng=np.random.default_rng(1)
f=lambda *s: rng.standard_normal(s,dtype=np.float32)
x=f(1,64); w=f(64); o=f(1,64); h=f(1,64); r=f(1,64)
q=f(1,1,1,64); k=f(1,1,1,64).astype(np.float16); v=k.copy(); fo=np.empty((1,1,1,64),np.float32)
x576=f(1,576); w576=f(576); o576=f(1,576)
w8=make_weight("Q8_0",64,64,rng); w4=make_weight("Q4_0",64,64,rng); w8p=w8.repack(); w4p=w4.repack()
xb=f(1,256); ob=f(1,1024); w4b=make_weight("Q4_0",1024,256,rng); w6b=make_weight("Q6_K",1024,256,rng); w6bp=w6b.repack()
o3=[f(1,64) for _ in range(3)]
xr=f(1,1,64); pos=np.arange(1,dtype=np.int32); yr=f(1,1,64); kc=np.zeros((16,1,64),np.float16)
cases={
 "softmax 1x64 out=":lambda: cpufuse.softmax(x,out=o),
 "rms_norm 1x64 out=":lambda: cpufuse.rms_norm(x,w,eps=1e-6,out=o),
 "add_rms_norm 1x64 out=":lambda: cpufuse.add_rms_norm(x,r,w,eps=1e-6,out=(h,o)),
 "flash_attn 1x1 f16 out=":lambda: cpufuse.flash_attn(q,k,v,scale=0.125,out=fo),
 "numba rms_norm 1x576":lambda: cpufuse.rms_norm(x576,w576,eps=1e-6,out=o576,isa="numba"),
 "numba softmax 1x576":lambda: cpufuse.softmax(x576,out=o576,isa="numba"),
 "rope out=":lambda: cpufuse.rope(xr,pos,n_dims=64,out=yr),
 "rope -> f16 cache":lambda: cpufuse.rope(xr,pos,n_dims=64,cache=(kc,3)),
 "matmul Q8_0 64x64 P16":lambda: cpufuse.matmul(x,w8p,out=o),
 "matmul Q8_0 64x64 GGUF":lambda: cpufuse.matmul(x,w8,out=o),
 "matmul Q4_0 64x64 GGUF":lambda: cpufuse.matmul(x,w4,out=o),
 "matmul_multi Q8_0 P16 3x64":lambda: cpufuse.matmul_multi(x,(w8p,w8p,w8p),out=o3),
 "matmul_swiglu Q4_0 P16":lambda: cpufuse.matmul_swiglu(x,w4p,w4p,out=o),
 "matmul+residual Q4_0 P16":lambda: cpufuse.matmul(x,w4p,out=o,residual=r),
 "matmul Q4_0 1024x256 GGUF q8":lambda: cpufuse.matmul(xb,w4b,out=ob,n_threads=1),
 "matmul Q6_K 1024x256 GGUF q8":lambda: cpufuse.matmul(xb,w6b,out=ob,n_threads=1),
 "matmul Q6_K 1024x256 P16 f32":lambda: cpufuse.matmul(xb,w6bp,out=ob,n_threads=1,act="f32"),
}
res={}
for name,fn in cases.items():
    fn()
    num=2000 if "1024" not in name else 50
    res[name]=min(timeit.repeat(fn,number=num,repeat=7))/num*1e6
print(json.dumps(res))
'''
trees={"base":sys.argv[1],"head":sys.argv[2]}
R={"base":[], "head":[]}
for rnd in range(3):
    for t in (("base","head") if rnd%2==0 else ("head","base")):
        env=dict(os.environ, PYTHONPATH=trees[t]); env.pop("OPENBLAS_CORETYPE",None); env.pop("OPENBLAS_L2_SIZE",None)
        out=subprocess.run(["taskset","-c","1",sys.executable,"-c",CHILD],env=env,capture_output=True,text=True,check=True).stdout
        R[t].append(json.loads(out.strip().splitlines()[-1]))
print("| call | base µs | head µs | head / base |\n|---|---:|---:|---:|")
for k in R["base"][0]:
    b=statistics.median(r[k] for r in R["base"]); h=statistics.median(r[k] for r in R["head"])
    print(f"| {k} | {b:.2f} | {h:.2f} | {h/b:.2f} |")
