"""The Ray Serve application: OpenAI ingress, decode and prefill deployments, routing, metrics, config.

Entry point `app.main:build_app`, named by the Serve configs in `configs/`.
"""
