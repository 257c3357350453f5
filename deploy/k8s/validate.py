#!/usr/bin/env python3
"""Validates rendered Kubernetes manifests (multi-document YAML on stdin or in files).

Built-in kinds go through kubernetes-validate (PyPI; the Kubernetes OpenAPI schemas, strict:
unknown fields are errors, as `kubectl apply` rejects them). Custom resources go through the
schemas vendored in schemas/ (KEDA, Gateway API), made strict the same way, with their
metadata checked against Kubernetes' ObjectMeta. A kind with no schema is an error, never a
warning, so nothing passes unchecked.

    kubectl kustomize deploy/k8s/overlays/doks | python3 deploy/k8s/validate.py -
"""

import argparse
import copy
import json
import pathlib
import sys

import jsonschema
import referencing
import kubernetes_validate
import yaml
from kubernetes_validate import utils as kv_utils

SCHEMAS = pathlib.Path(__file__).resolve().parent / "schemas"
# DOKS's supported releases include it; kubernetes-validate ships schemas up to its own
# version and picks the newest not after this one.
DEFAULT_VERSION = "1.31"


def strict(schema):
    """Rejects unknown fields in every object that lists its properties, unless it says it
    keeps unknown fields (x-kubernetes-preserve-unknown-fields), as the API server does."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
                and "additionalProperties" not in node
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def vendored():
    """(apiVersion, kind) -> strict schema, from schemas/*.json."""
    out = {}
    for path in sorted(SCHEMAS.glob("*.json")):
        schema = json.loads(path.read_text())
        props = schema["properties"]
        out[(props["apiVersion"]["const"], props["kind"]["const"])] = strict(schema)
    return out


def object_meta_validator(version):
    """A validator for metadata: Kubernetes' ObjectMeta, from kubernetes-validate's schemas."""
    probe = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
    kv_utils.validate(probe, version, strict=True)  # fails early on an unknown version
    versions = [v for v in kv_utils.all_versions() if kv_utils.major_minor(v) <= version]
    schema_dir = "v%s-local-strict" % versions[-1]
    definitions = kv_utils.schema_contents(
        "kubernetes-json-schema/%s/_definitions.json" % schema_dir, version
    )
    registry = referencing.Registry().with_resource(
        definitions["$id"], referencing.Resource.from_contents(definitions)
    )
    schema = {"$ref": definitions["$id"] + "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    return jsonschema.Draft202012Validator(schema, registry=registry)


def describe(doc):
    meta = doc.get("metadata") or {}
    return "%s/%s %s" % (doc.get("apiVersion"), doc.get("kind"), meta.get("name"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="YAML files, - for standard input")
    parser.add_argument("-k", "--kubernetes-version", default=DEFAULT_VERSION)
    args = parser.parse_args()
    crds = vendored()
    meta = object_meta_validator(args.kubernetes_version)
    errors = []
    count = 0
    for name in args.files:
        text = sys.stdin.read() if name == "-" else pathlib.Path(name).read_text()
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            count += 1
            key = (doc.get("apiVersion"), doc.get("kind"))
            if key in crds:
                found = [
                    "%s: %s: %s" % (describe(doc), "/".join(map(str, e.absolute_path)), e.message)
                    for e in jsonschema.Draft202012Validator(crds[key]).iter_errors(doc)
                ]
                found += [
                    "%s: metadata/%s: %s"
                    % (describe(doc), "/".join(map(str, e.absolute_path)), e.message)
                    for e in meta.iter_errors(doc.get("metadata", {}))
                ]
                errors += found
                continue
            try:
                kv_utils.validate(doc, args.kubernetes_version, strict=True)
            except kv_utils.ValidationError as e:
                path = "/".join(map(str, e.path))
                errors.append("%s: %s: %s" % (describe(doc), path, e.message))
            except kv_utils.SchemaNotFoundError as e:
                errors.append("%s: no schema: %s (vendor one in %s)" % (describe(doc), e.message, SCHEMAS))
    for error in errors:
        print("ERROR " + error)
    print(
        "validated %d objects against Kubernetes %s (kubernetes-validate %s) and %d vendored "
        "CRD schemas: %d errors"
        % (count, args.kubernetes_version, kubernetes_validate.__version__, len(crds), len(errors))
    )
    return 1 if errors or count == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
