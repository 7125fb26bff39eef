"""Compile a Triton kernel for sm_90 without a GPU; dump PTX/cubin + a SASS summary.
usage: compile.py module kernel '{sig}' '{constexprs}' '[div16 args]' '{options}'"""
import sys, json, importlib, subprocess, glob, collections, re, os
sys.path.insert(0, os.getcwd())
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
mod, name = sys.argv[1], sys.argv[2]
fn = getattr(importlib.import_module(mod), name)
sig = json.loads(sys.argv[3]); consts = json.loads(sys.argv[4])
div = json.loads(sys.argv[5]) if len(sys.argv) > 5 else []
opts = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
for k in consts: sig[k] = "constexpr"
names = fn.arg_names
attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div}
src = ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
tag = sys.argv[7] if len(sys.argv) > 7 else name
open(f"/tmp/kc/{tag}.ptx", "w").write(k.asm["ptx"])
open(f"/tmp/kc/{tag}.cubin", "wb").write(k.asm["cubin"])
bin_ = glob.glob("/work/main/.venv/lib/python3*/site-packages/triton/backends/nvidia/bin")[0]
res = subprocess.run([f"{bin_}/cuobjdump", "--dump-resource-usage", f"/tmp/kc/{tag}.cubin"], capture_output=True, text=True).stdout
sass = subprocess.run([f"{bin_}/nvdisasm", "-c", f"/tmp/kc/{tag}.cubin"], capture_output=True, text=True).stdout
open(f"/tmp/kc/{tag}.sass", "w").write(sass)
ops = collections.Counter(re.findall(r"\b(LDG[A-Z0-9._]*|STG[A-Z0-9._]*|LDGSTS[A-Z0-9._]*|ATOMG[A-Z0-9._]*|REDG?[A-Z0-9._]*|HMMA[A-Z0-9._]*|HGMMA[A-Z0-9._]*|MEMBAR[A-Z0-9._]*|CCTL[A-Z0-9._]*|LDL[A-Z0-9._]*|STL[A-Z0-9._]*|UTMALDG[A-Z0-9._]*)", sass))
print(tag, re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", res).group(0), "warps", k.metadata.num_warps, "stages", k.metadata.num_stages)
print("  ", dict(ops))
