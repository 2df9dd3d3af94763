# sourced at the top of every device call: offline install of the wheelhouse, environment, GPU name
python3 -m pip install -q --no-index --no-deps --find-links .whl --target /tmp/site -r .whl/requirements.txt > $OUT/pip.log 2>&1 || echo "pip rc=$?"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
left() { echo $(( ${DEADLINE:-570} - SECONDS )); }
export TITAN_MEGAMOE_COMMIT=$(cat .devrun/commit 2>/dev/null)
