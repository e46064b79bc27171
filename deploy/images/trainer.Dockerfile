# syntax=docker/dockerfile:1
# The training image: Ray 2.60 (the version resilienced speaks to), CUDA, Python 3.11, with
# trainer/ (python -m trainer, and trainer.resilience for your own Ray Train script: docs/your-trainer.md)
# and torch pinned.  Head and workers of a RayJob use it.
#   docker build -f deploy/images/trainer.Dockerfile -t resilienced-trainer:0.1.0 .
# torch's CUDA wheels bring their own CUDA runtime and NCCL; the EFA libfabric provider and the
# aws-ofi-nccl plugin come from the node (EFA device plugin) or, for a fully EFA-tuned stack, use
# AWS's Ray Train DLC as the base instead (same Ray version).
FROM rayproject/ray:2.60.0-py311-gpu
# checkov:skip=CKV_DOCKER_2: No HEALTHCHECK: Kubernetes ignores it; KubeRay gives every Ray pod liveness and readiness probes of its own (raylet and dashboard agent health).

# The image's own user, ray (uid 1000, gid 100 users), and its conda Python.
USER 1000:100
WORKDIR /home/ray/trainer
COPY --chown=1000:100 deploy/images/trainer-requirements.txt /home/ray/trainer/requirements.txt
RUN pip install --no-cache-dir -r /home/ray/trainer/requirements.txt
# trainer/ is a plain package with no dependency on resilienced/ (it never imports it):
# put it on the path rather than installing the daemon's distribution.
COPY --chown=1000:100 trainer /home/ray/trainer/trainer
ENV PYTHONPATH=/home/ray/trainer \
    RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S=0.5
