# The training image: NVIDIA's NGC PyTorch container (CUDA, cuDNN, NCCL, and torch, Transformer Engine
# and apex built for them) plus this project. Nothing the image ships is replaced: the project and
# the few libraries it adds are installed with --no-deps, so pip never swaps the image's torch,
# transformer-engine or apex for PyPI builds.
#
#   docker build -t mcore-template:26.08-py3 .        # launch/docker.sh builds it on first use
#   docker build --build-arg NGC_TAG=<newer>-py3 -t mcore-template:<newer>-py3 .
#     (then run with NGC_TAG=<newer>-py3 launch/docker.sh, or change both defaults together:
#      tests/test_launch.py checks that this ARG and launch/docker.sh's NGC_TAG agree)
#
# 26.08: a release Megatron-LM's own CI image builds on (docker/.ngc_version.dev); Python 3.12 as
# pyproject.toml requires.
ARG NGC_TAG=26.08-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

WORKDIR /workspace/mcore-template

# What pyproject.toml needs beyond the image, at the versions of constraints.txt. Their own
# requirements besides torch (numpy, packaging, PyYAML, psutil, tensorboard) ship with the image;
# the import below fails the build if one does not. PIP_CONSTRAINT (the image's pin list) is cleared
# for these two commands only, as Megatron-Core's install guide does: with --no-deps nothing pinned can
# change, and the editable build's own setuptools>=77 must not meet the image's setuptools pin.
RUN PIP_CONSTRAINT= pip install --no-cache-dir --no-deps \
        megatron-core==0.19.2 hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3

# Editable install: launch/docker.sh mounts the repository over this directory, so code edits on the
# host take effect without a rebuild.
COPY . .
RUN PIP_CONSTRAINT= pip install --no-cache-dir --no-deps -e . \
 && python -c "import megatron.core, hydra, omegaconf, yaml, psutil, tensorboard, torch, models, training.config.schema; \
print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"

CMD ["launch/train.sh"]
