"""Print the CUDA outcome of named conformance cases (status and full detail)."""
import sys, traceback
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "tests" / "conformance"))
import test_cuda_conformance as tc
from node_cases import all_cases
store = tc.PlanStore(Path("/tmp/no-plans"))
for name in sys.argv[1:]:
    try:
        outcome, source = tc.run_cuda_case(all_cases()[name], store)
        print(name, outcome.status, outcome.detail[:3000], flush=True)
    except Exception:
        print(name, "EXC", traceback.format_exc()[-3000:], flush=True)
