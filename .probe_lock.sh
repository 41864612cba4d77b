set -x
mount -t tmpfs none /tmp || exit 9
PY=/work/main/.venv/bin/python
env -u ALLOW_MULTIPLE_LIBTPU_LOAD JAX_PLATFORMS=cpu $PY -c "
from jax.experimental import topologies
topologies.get_topology_desc(platform='tpu', topology_name='v5p:2x2x1')
print('A holds', flush=True)
import time; time.sleep(240)" > /tmp/a.log 2>&1 &
A=$!
for i in $(seq 60); do grep -q "A holds" /tmp/a.log && break; sleep 1; done
ls -la /tmp/libtpu_lockfile; cat /tmp/a.log | tail -2
env -u ALLOW_MULTIPLE_LIBTPU_LOAD PYTHONPATH=$PWD timeout 300 $PY -m titan_jax.cli compile --config configs/qwen3_debug.toml --topology v5p-8 --training.seq_len 128 --training.local_batch_size 1 > /tmp/b.log 2>&1
echo "B rc=$?"; grep -v "^ " /tmp/b.log | tail -4
kill $A
