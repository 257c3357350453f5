#!/usr/bin/env python3
"""Parse every vLLM container's command line in rendered manifests with vLLM's own parser.

    kubectl kustomize deploy/k8s/overlays/doks | python3 deploy/k8s/check_vllm_args.py -

For each container started as `vllm serve`, this builds the argument parser `vllm serve` uses
(`make_arg_parser`), parses the container's args with it, and turns them into the engine's
arguments (`AsyncEngineArgs.from_cli_args`), so an unknown flag, a malformed
`--kv-events-config` / `--kv-transfer-config` JSON or an unknown key in it fails here instead
of at the pod's start on a GPU node. It prints what vLLM understood: the model, block size,
prefix caching and the KV event and transfer settings the gateway relies on.

It needs vLLM installed (`pip install vllm`: several GB with its torch dependency), so CI does
not run it; docs/DEPLOY.md records the version last checked. No GPU is needed: the script sets
`VLLM_TARGET_DEVICE=cpu` (unless set) so that vLLM's device detection does not stop the parse.
Exit status: 0 when every vLLM container parses, 1 otherwise, 2 when vLLM is missing.
"""

import os
import sys

import yaml


def vllm_containers(documents):
    """(object name, container) for each container whose command is `vllm serve`."""
    for doc in documents:
        if not isinstance(doc, dict):
            continue
        pod = doc.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []):
            if container.get("command", [])[:2] == ["vllm", "serve"]:
                yield doc["metadata"]["name"], container


def main() -> int:
    # Without a GPU vLLM cannot infer its device; parsing the arguments needs none.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm  # noqa: F401  (the version is reported below)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:
        print(f"vLLM is not installed ({e}); pip install vllm, then run again", file=sys.stderr)
        return 2

    source = sys.stdin if sys.argv[1:] in ([], ["-"]) else open(sys.argv[1], encoding="utf-8")
    found = 0
    failed = 0
    for name, container in vllm_containers(yaml.safe_load_all(source)):
        found += 1
        args = [str(a) for a in container.get("args", [])]
        parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve", exit_on_error=False))
        try:
            namespace = parser.parse_args(args)
            # `vllm serve MODEL` takes the model as a positional argument.
            if namespace.model_tag:
                namespace.model = namespace.model_tag
            engine = AsyncEngineArgs.from_cli_args(namespace)
        except (Exception, SystemExit) as e:  # argparse exits on unknown flags
            failed += 1
            print(f"FAIL {name}/{container['name']}: {e!r}")
            continue
        events = engine.kv_events_config
        transfer = engine.kv_transfer_config
        print(
            f"ok   {name}/{container['name']}: model={engine.model} "
            f"block_size={engine.block_size} prefix_caching={engine.enable_prefix_caching} "
            f"kv_events={events!r} kv_transfer={transfer!r}"
        )
    print(f"vLLM {vllm.__version__}: {found} container(s), {failed} failed")
    if found == 0:
        print("no `vllm serve` container in the input", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
