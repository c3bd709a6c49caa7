# Source this on a GPU machine, from the repository root, with .gpu-bundle carried along:
#
#     . scripts/gpu_env.sh && python scripts/gpu_bundle.py check
#     . scripts/gpu_env.sh && python -m pytest -m gpu tests/test_launcher_gpu.py
#
# It exports the settings those machines need, installs the bundle's wheels (what is missing or
# older; nothing on a machine that already has them) into .gpu-site/ (git-ignored; kept between
# runs while the machine stays warm) and puts that folder on PYTHONPATH and PATH. Exported, so
# that Ray's workers and the launcher's roles see it too. FERRULE_GPU_SITE chooses another
# folder, FERRULE_GPU_BUNDLE another bundle, PYTHON another interpreter.

# DeepSpeed's op builder fails on the image's "9.0a"; a first Ray start without the second hung.
export TORCH_CUDA_ARCH_LIST=9.0
export RAY_USAGE_STATS_ENABLED=0
# Multi-GPU kinds: NVLink multicast off, in every process (harmless on one GPU).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if [ -z "${PYTHON:-}" ]; then
    if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
FERRULE_GPU_SITE="${FERRULE_GPU_SITE:-$PWD/.gpu-site}"
FERRULE_GPU_BUNDLE="${FERRULE_GPU_BUNDLE:-$PWD/.gpu-bundle}"
export FERRULE_GPU_SITE

case ":${PYTHONPATH:-}:" in
    *":$FERRULE_GPU_SITE:"*) ;;
    *) export PYTHONPATH="$FERRULE_GPU_SITE${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
case ":$PATH:" in
    *":$FERRULE_GPU_SITE/bin:"*) ;;
    *) export PATH="$FERRULE_GPU_SITE/bin:$PATH" ;;
esac

"$PYTHON" scripts/gpu_bundle.py install --from "$FERRULE_GPU_BUNDLE" --target "$FERRULE_GPU_SITE" \
    || { echo "gpu_env.sh: installing the bundle failed (see above)" >&2; false; }
