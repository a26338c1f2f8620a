"""experiments.pd_http's deployments are what the servers it starts build (the full benchmark starts 5
processes per point and runs for most of an hour; results/paper/part2_laptop holds a committed run)."""

import pytest

import glm53
from experiments import pd_http
from glm53 import serve


@pytest.mark.parametrize("layout", pd_http.DECODE_LAYOUTS)
def test_each_deployment_is_four_devices_of_producers_and_consumers_with_one_page_size(layout):
    cfg = glm53.get_preset("tiny")
    specs = pd_http.deployments(pd_http.DEPLOY, layout)
    assert set(specs) == {"pcp_dcp+hisparse", "dp+offload"}
    for name, spec in specs.items():
        devices, page_tokens, policies, kv, listed = 0, set(), set(), set(), set()
        for role, want in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            for extra in spec[role]:
                args = serve.build_parser().parse_args(["tiny", *pd_http._server_args(pd_http.DEPLOY, extra)])
                d = serve.deploy_from_args(args, cfg, "float32").resolved(cfg, "float32")
                assert d.kv_role == want and d.kv_transfer_config["kv_connector"] == "PdConnector"
                assert (d.max_model_len, d.max_num_seqs, d.max_num_batched_tokens) == (
                    pd_http.DEPLOY["max_model_len"], pd_http.DEPLOY["max_num_seqs"],
                    pd_http.DEPLOY["max_num_batched_tokens"])
                devices += d.devices_per_replica * d.data_parallel_size
                # a chunk (a page) must cover the same tokens on producer and consumer to be shared
                page_tokens.add(d.block_size * d.decode_context_parallel_size)
                if role == "decode":
                    # dp_ep: one server of two ranks that share the experts, else one-device servers
                    assert (d.experts_across_ranks, d.data_parallel_size) == ((True, 2) if layout == "dp_ep" else (False, 1))
                    policies.add(d.kv_policy)
                    listed.add(d.pd_producers)
                else:
                    kv.add(f"127.0.0.1:{d.kv_transfer_config['kv_port']}")
                    if name.startswith("pcp_dcp"):
                        assert (d.prefill_context_parallel_size, d.decode_context_parallel_size) == (2, 2)
                        assert d.enable_expert_parallel
        assert devices == pd_http.DEVICES, name
        assert page_tokens == {pd_http.DEPLOY["block_size"]}, name
        assert policies == {"hisparse" if name.endswith("hisparse") else "offload"}, name
        assert listed == {tuple(sorted(kv))} and len(kv) == len(spec["prefill"]), name  # every consumer lists them all
