"""The Serve application builder: `app.main:build_app`, named by `import_path` in the configs.

Validates the Serve config's `args` into an `AppConfig`, resolves the model
(writing the tiny model on first run when asked), and binds the graph:
ingress -> decode -> prefill, or ingress -> decode alone when there are no
prefill replicas (colocated). The decode deployment routes through
`AffinityRouter`.
"""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.config import AppConfig
from app.decode import DecodeServer
from app.ingress import OpenAIIngress
from app.prefill import PrefillServer
from app.router import AffinityRouter

logger = logging.getLogger(__name__)


def build_app(args: dict[str, Any] | None = None) -> Application:
    """Builds the application from the Serve config's `args`; raises `ConfigError` for bad args."""
    config = AppConfig.from_args(args).resolved()
    config.engine_config("decode")  # fails here, not on the replicas, when the engine would refuse it
    config.engine_config("prefill")
    prefill = None
    if config.prefill.num_replicas:
        prefill_deployment = serve.deployment(PrefillServer, name="PrefillServer")
        prefill = prefill_deployment.options(**config.prefill.serve_options()).bind(config)
    decode_deployment = serve.deployment(DecodeServer, name="DecodeServer").options(
        **config.decode.serve_options(),
        request_router_config=RequestRouterConfig(request_router_class=AffinityRouter),
    )
    decode = decode_deployment.bind(config, prefill)
    ingress = serve.deployment(serve.ingress()(OpenAIIngress), name="OpenAIIngress")
    logger.info("serving %s: %d decode, %d prefill replicas; API key %s", config.model_id,
                config.decode.num_replicas, config.prefill.num_replicas,
                "required" if config.api.api_key_sha256 else "not set where the app is built")
    return ingress.options(**config.ingress.serve_options()).bind(config, decode)
