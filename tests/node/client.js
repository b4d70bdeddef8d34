// A Node.js client of nanokv.v1.Generation: streams one generation and prints what it got as JSON.
//   node client.js ADDRESS PROTO_DIR PROMPT MAX_TOKENS [API_KEY]
// The Python test (tests/gateway/test_grpc_node.py) checks the answer against the engine's own.
"use strict";
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [address, protoDir, prompt, maxTokens, apiKey] = process.argv.slice(2);
const def = protoLoader.loadSync("nanokv_v1.proto", {
  includeDirs: [protoDir], keepCase: true, longs: Number, defaults: true, oneofs: true,
});
const v1 = grpc.loadPackageDefinition(def).nanokv.v1;
const client = new v1.Generation(address, grpc.credentials.createInsecure());
const metadata = new grpc.Metadata();
if (apiKey) metadata.add("authorization", `Bearer ${apiKey}`);

function modelInfo() {
  return new Promise((resolve, reject) =>
    client.GetModelInfo({}, metadata, (err, info) => (err ? reject(err) : resolve(info))));
}

function generate(request) {
  return new Promise((resolve) => {
    const result = { chunks: 0, token_ids: [], text: "", finish_reason: null, usage: null, error: null };
    const call = client.Generate(request, metadata);
    call.on("data", (chunk) => {
      result.chunks += 1;
      result.token_ids.push(...chunk.token_ids);
      result.text += chunk.text;
      if (chunk.finished) {
        result.finish_reason = chunk.finish_reason;
        result.usage = chunk.usage;
      }
    });
    call.on("error", (err) => { result.error = { code: err.code, details: err.details }; resolve(result); });
    call.on("end", () => resolve(result));
  });
}

(async () => {
  const info = await modelInfo();
  const params = { max_tokens: Number(maxTokens), temperature: 0 };
  const ok = await generate({ text: prompt, sampling_params: params });
  const bad = await generate({ text: prompt, sampling_params: { ...params, top_p: 2 } });
  console.log(JSON.stringify({ model: info.name, ok, bad, invalid_argument: grpc.status.INVALID_ARGUMENT }));
  client.close();
})().catch((err) => { console.error(err); process.exit(1); });
