"""GLM-5.3 long-context serving in JAX / Pallas: one distribution, packages glm53, attention, kvcache,
parallel. experiments/ and configs/ are run from the repository root and are not installed."""

from setuptools import find_packages, setup

setup(
    name="glm53-jax",
    version="0.1.0",
    description="GLM-5.3 (MLA + DSA lightning indexer + MoE + MTP) and its long-context serving stack in JAX",
    python_requires=">=3.12",
    packages=find_packages(include=["glm53", "glm53.*", "attention", "attention.*", "kvcache", "kvcache.*",
                                    "parallel", "parallel.*"]),
    package_data={"glm53.perfmodel": ["published.json"],  # the cited measurements the model is calibrated on
                  "glm53": ["templates/*.jinja"]},  # the presets' chat templates
    install_requires=[
        "jax==0.11.2",  # the lent H200 image runs 0.11.2: CPU and GPU run the same JAX
        "flax>=0.12.12,<0.13",
        "numpy",
        "ml_dtypes",  # bfloat16 / float8 numpy types for checkpoint I/O (also a jax dependency)
        "einops",
        "absl-py",
        "orbax-checkpoint>=0.12.8",
        "safetensors",
        "ml_collections",
        "matplotlib",
        "tqdm",
        "prometheus_client",
        "msgspec",  # KV events and the peer KV tier's messages: vLLM's msgpack structs (kvcache.events, .tiers.p2p)
        "pyzmq",  # KV events (PUB and replay sockets) and the peer KV tier's control channel (kvcache.tiers.p2p)
        "boto3",  # the object-store KV tier's client (kvcache.tiers.obj)
        "fastapi",  # the OpenAI-compatible server (glm53.serve)
        "uvicorn",
        "httpx",  # the router's client of the prefill and decode servers (glm53.router)
        "tokenizers",  # a checkpoint's tokenizer.json (glm53.tokenizer)
        "jinja2",  # chat templates
    ],
    extras_require={
        # moto's S3 backend and its server (flask): the S3-compatible server the object tier's tests start
        # on loopback (moto[server] would pull every AWS service's dependencies)
        # openai: the official client, driving the server and the router as an unmodified client would
        "test": ["pytest", "hypothesis", "pytest-xdist", "moto[s3]", "flask", "flask-cors", "openai"],
        "cuda12": ["jax[cuda12]==0.11.2"],
        "cuda13": ["jax[cuda13]==0.11.2"],
    },
)
