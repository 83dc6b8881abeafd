"""kvtier's ``vllm.general_plugins`` entry point: registers kvtier's tier types, spec and connector
name with vLLM.

vLLM runs every installed general plugin in each of its processes (API server, engine core,
workers) before it reads the configuration, so ``"type": "kvtier_disk"`` and
``"spec_name": "KVTierOffloadingSpec"`` resolve without module paths. Registration is lazy on
vLLM's side (the classes are imported when first used), and this module imports only vLLM's
registries. ``VLLM_PLUGINS`` (a comma-separated allow-list) must name ``kvtier`` where it is set.

The connector's name (:func:`register_connector_name`, also run when :mod:`kvtier.vllm.connector`
is imported) is for vLLM's MultiConnector: its logging process rebuilds each child's stats from the
child's class NAME through ``KVConnectorFactory.get_connector_class_by_name``, which knows only
registered names (vLLM 0.32 and 0.33, ``MultiConnector.build_kv_connector_stats``); an unregistered
``KVTierConnector`` child made the first stats interval raise "Connector 'KVTierConnector' is not
registered" and stop the engine's output loop.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

MODULE = "kvtier.vllm.native"
TIER_TYPES = {"kvtier_disk": "KVTierDiskTier", "kvtier_redis": "KVTierRedisTier", "kvtier_s3": "KVTierS3Tier",
              "kvtier_node": "KVTierNodeTier"}
SPEC_NAME = "KVTierOffloadingSpec"
CONNECTOR_NAME = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.vllm.connector"
MODULES = {SPEC_NAME: "spec", "KVTierNodeTier": "node_tier"}
"""The module (under :data:`MODULE`) of each registered class not in ``tiers``."""


def register() -> None:
    """Register :data:`TIER_TYPES` with vLLM's ``SecondaryTierFactory`` and :data:`SPEC_NAME` with its
    ``OffloadingSpecFactory``. A name already registered (this plugin loaded twice in a process, or
    another package's) is left as it is."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    registrations = [(SecondaryTierFactory.register_tier, name, cls) for name, cls in TIER_TYPES.items()]
    registrations.append((OffloadingSpecFactory.register_spec, SPEC_NAME, SPEC_NAME))
    for register_one, name, class_name in registrations:
        try:
            register_one(name, f"{MODULE}.{MODULES.get(class_name, 'tiers')}", class_name)
        except ValueError:
            logger.debug("kvtier: %s is already registered with vLLM; left as it is", name)
    register_connector_name()


def register_connector_name() -> None:
    """Register :data:`CONNECTOR_NAME` with vLLM's ``KVConnectorFactory`` (lazily: the class is
    imported from :data:`CONNECTOR_MODULE` when first looked up by name). Idempotent; a name
    already registered (this function run twice in a process, or another package's) is left as it is."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:
        logger.debug("kvtier: %s is already registered with vLLM; left as it is", CONNECTOR_NAME)
