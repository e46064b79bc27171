"""What operators see: ``metrics`` (Prometheus), ``http`` (``/metrics``, ``/healthz``,
``/readyz``), ``notify`` (the webhook), ``run_record`` (what the daemon did to a run, as
``status`` and notifications show it), ``permissions`` (the RBAC rules and IAM actions the
manifests grant).  A face: it imports nothing."""
