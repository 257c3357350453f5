// Validates rendered KEDA and Gateway API objects against the upstream schemas, as the
// kubernetes-models packages generate them from KEDA's API types and Gateway API's CRDs
// (types, required fields, enums, formats). deploy/k8s/validate.py checks the same objects
// strictly against kvroute's own schemas (unknown fields rejected, which the upstream CRD
// schemas leave to the API server); together they stand in for a cluster's admission.
//
//   node deploy/k8s/crd-check/validate.mjs < objects.json   (a JSON array of objects)
//
// Prints one line per object of a kind it knows; exit status 1 if any fails.
import fs from "node:fs";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
import { TriggerAuthentication } from "@kubernetes-models/keda/keda.sh/v1alpha1/TriggerAuthentication";
import { Gateway } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/Gateway";
import { HTTPRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute";

const models = {
  "keda.sh/v1alpha1/ScaledObject": ScaledObject,
  "keda.sh/v1alpha1/TriggerAuthentication": TriggerAuthentication,
  "gateway.networking.k8s.io/v1/Gateway": Gateway,
  "gateway.networking.k8s.io/v1/HTTPRoute": HTTPRoute,
};

const objects = JSON.parse(fs.readFileSync(0, "utf8"));
let failed = 0;
for (const object of objects) {
  const Model = models[`${object.apiVersion}/${object.kind}`];
  if (!Model) continue;
  const name = `${object.kind} ${object.metadata?.name}`;
  try {
    new Model(object).validate();
    console.log(`ok   ${name}`);
  } catch (e) {
    failed += 1;
    console.log(`FAIL ${name}: ${e.message}`);
  }
}
process.exit(failed ? 1 : 0);
