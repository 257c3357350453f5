# kvroute's operational targets (seed 004's, where they fit). `make help` lists them.
# Kubernetes targets act on the current kubectl context; docs/DEPLOY.md walks through them.

# base: simulated workers, no GPU · disagg: simulated prefill and decode pools · vllm: real vLLM
# workers · doks: seed 004 on DigitalOcean (vLLM prefill/decode pools, GPUs, NFS, Gateway API,
# KEDA)
OVERLAY ?= base
NAMESPACE ?= kvroute
IMAGE_REPO ?= kvroute
IMAGE_TAG ?= dev
IMAGE := $(IMAGE_REPO):$(IMAGE_TAG)
# The kvroute image's name in each overlay's kustomization (doks names a registry): IMAGE
# replaces whichever the overlay uses.
IMAGE_NAMES := kvroute registry.digitalocean.com/your-registry/kvroute
# The model name the gateway serves: llama-3.1-70b-instruct (simulated) or the overlays' vLLM one.
MODEL ?= $(if $(filter base disagg,$(OVERLAY)),llama-3.1-70b-instruct,llama-3.1-8b-instruct)
CONCURRENCY ?= 60
GRAFANA_NAMESPACE ?= monitoring
KUBECTL ?= kubectl
# Rendered manifests (with IMAGE applied) land here; target/ is git-ignored.
BUILD := target/deploy/$(OVERLAY)
PF := deploy/scripts/port-forward.sh $(NAMESPACE)
# The load generator's API token (Secret kvroute-loadgen, made by `make deploy`), as a curl header.
LOADGEN_AUTH = -H "authorization: Bearer $$($(KUBECTL) -n $(NAMESPACE) get secret kvroute-loadgen -o jsonpath='{.data.api-token}' | base64 -d)"

.PHONY: help image push manifests validate deploy teardown demo-local demo-start demo-stop \
	demo-status demo-ui test-inference test-kv-cache validate-all validate-vllm dashboards

help: ## This list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-15s %s\n", $$1, $$2}'

image: ## Build the container image IMAGE_REPO:IMAGE_TAG (deploy/Dockerfile)
	docker build -f deploy/Dockerfile -t $(IMAGE) .

push: ## Push the image (DigitalOcean: doctl registry login first)
	docker push $(IMAGE)

manifests: ## Render OVERLAY with IMAGE into target/deploy/OVERLAY/all.yaml
	@mkdir -p $(BUILD)
	@printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - ../../../deploy/k8s/overlays/$(OVERLAY)\nimages:\n' \
		| sed 's#overlays/base#base#' > $(BUILD)/kustomization.yaml
	@for name in $(IMAGE_NAMES); do \
		printf '  - name: %s\n    newName: $(IMAGE_REPO)\n    newTag: "$(IMAGE_TAG)"\n' $$name; \
	done >> $(BUILD)/kustomization.yaml
	$(KUBECTL) kustomize $(BUILD) > $(BUILD)/all.yaml
	@echo "rendered $(BUILD)/all.yaml ($(IMAGE))"

validate: ## Check every overlay as CI does: render, schemas, kvroute command lines
	@[ -d deploy/k8s/crd-check/node_modules/@kubernetes-models/keda ] || npm ci --prefix deploy/k8s/crd-check --no-audit --no-fund
	cargo test --offline -p kvroute --test deploy_manifests
	cargo test --offline -p kvroute --bin kvroute deploy_

validate-vllm: ## Parse the vllm and doks overlays' vLLM command lines with vLLM's own parser (needs pip install vllm)
	@for overlay in vllm doks; do \
		$(KUBECTL) kustomize deploy/k8s/overlays/$$overlay | python3 deploy/k8s/check_vllm_args.py - || exit 1; \
	done

deploy: manifests ## Apply OVERLAY to the cluster and wait for it to be ready
	$(KUBECTL) apply -f $(BUILD)/all.yaml
	@# The load generator listens on the pod's address: its control API needs a token.
	@$(KUBECTL) -n $(NAMESPACE) get secret kvroute-loadgen >/dev/null 2>&1 || \
		$(KUBECTL) -n $(NAMESPACE) create secret generic kvroute-loadgen \
		--from-literal=api-token=$$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
	$(KUBECTL) -n $(NAMESPACE) rollout status deployment/gateway --timeout=10m
	$(KUBECTL) -n $(NAMESPACE) rollout status deployment/loadgen --timeout=10m
	@echo "make demo-ui opens the dashboard (it prints the URL with the token); make demo-start starts the workload"

teardown: manifests ## Delete everything OVERLAY created (the NFS volume's data stays)
	$(KUBECTL) delete --ignore-not-found -f $(BUILD)/all.yaml

demo-local: ## The whole demo on this machine, with Prometheus for the Grafana dashboards
	cargo run --release -- demo --prometheus

demo-start: ## Start the workload at CONCURRENCY conversations
	@$(PF) loadgen 18080:8080 -- curl -fsS -X POST http://127.0.0.1:18080/api/workload/start \
		$(LOADGEN_AUTH) -H 'content-type: application/json' -d '{"concurrency": $(CONCURRENCY)}' >/dev/null
	@echo "demo-start: $(CONCURRENCY) conversations"

demo-stop: ## Stop the workload
	@$(PF) loadgen 18080:8080 -- curl -fsS -X POST http://127.0.0.1:18080/api/workload/stop $(LOADGEN_AUTH) >/dev/null
	@echo "demo-stop: stopped"

demo-status: ## Pods, GPU allocation and the load generator's live figures
	$(KUBECTL) -n $(NAMESPACE) get pods -o wide
	@$(KUBECTL) get nodes -o custom-columns='NODE:.metadata.name,GPUS:.status.allocatable.nvidia\.com/gpu'
	@$(PF) loadgen 18080:8080 -- curl -fsS $(LOADGEN_AUTH) http://127.0.0.1:18080/api/status | python3 -c \
		'import json,sys; s=json.load(sys.stdin); print("running:", s["running"], "concurrency:", s["concurrency"]); [print(l["name"], {k: l["metrics"][k] for k in ("ttft_ms", "tpot_ms", "kv_hit_rate", "queued", "errors")}) for l in s["lanes"]]'

demo-ui: ## Port-forward the load generator's dashboard to http://127.0.0.1:8080/?token=…
	@echo "open http://127.0.0.1:8080/?token=$$($(KUBECTL) -n $(NAMESPACE) get secret kvroute-loadgen -o jsonpath='{.data.api-token}' | base64 -d)"
	$(KUBECTL) -n $(NAMESPACE) port-forward svc/loadgen 8080:8080

test-inference: ## Send one chat completion through the gateway
	@$(PF) gateway 18000:8000 -- deploy/scripts/test-inference.sh http://127.0.0.1:18000 $(MODEL)

test-kv-cache: ## A two-turn conversation: turn 2 must hit turn 1's KV cache
	@$(PF) gateway 18000:8000 -- deploy/scripts/test-kv-cache.sh http://127.0.0.1:18000 $(MODEL)

validate-all: test-inference test-kv-cache ## All checks against the running cluster

dashboards: ## Apply the Grafana dashboard ConfigMaps to GRAFANA_NAMESPACE (sidecar import)
	$(KUBECTL) apply -k deploy/grafana -n $(GRAFANA_NAMESPACE)
	@echo "or import deploy/grafana/*.json in Grafana (Dashboards > New > Import)"
