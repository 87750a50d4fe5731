// llama.cpp as a contestant of benchmarks/serve_cpu.py: one GGUF model in one Node process, driven through the
// Node API of the npm package node-llama-cpp (its prebuilt llama.cpp; benchmarks/llamacpp.py installs it).
//
//     node benchmarks/llamacpp_bench.mjs INSTALL_DIR MODEL.gguf THREADS CONTEXT
//
// INSTALL_DIR holds node_modules/node-llama-cpp. Commands arrive as JSON lines on stdin; each gets one JSON line on
// stdout, prefixed with "@@ " (llama.cpp's own logging goes to stderr). Token ids come from the Python side (the
// Hugging Face tokenizer), so every contestant sees the same ids.
//
//   {"op": "info"}                                   -> llama.cpp release, CPU backend, threads
//   {"op": "generate", "prompt": [ids], "new_tokens": N, "stop_at_eos": bool}
//        -> {"tokens": [...], "times": [s, ...]}: greedy; times[0] is the call, times[i] the i-th token's arrival
//   {"op": "nll", "tokens": [ids]}                   -> {"nll": sum of -log p(token i | tokens < i), i >= 1, "count"}
//   {"op": "rss"}                                    -> {"peak_rss": bytes (getrusage ru_maxrss)}
//   {"op": "quit"}
// Every command runs on a fresh KV cache (the sequence's history cleared first).

import fs from "node:fs";
import path from "node:path";
import readline from "node:readline";
import {pathToFileURL} from "node:url";

const [installDir, modelPath, threadsArg, contextArg] = process.argv.slice(2);
if (!installDir || !modelPath) {
    console.error("usage: node llamacpp_bench.mjs INSTALL_DIR MODEL.gguf THREADS CONTEXT");
    process.exit(2);
}
const threads = Number(threadsArg ?? 2);
const contextSize = Number(contextArg ?? 2048);
const packageDir = path.join(installDir, "node_modules", "node-llama-cpp");
const packageJson = JSON.parse(fs.readFileSync(path.join(packageDir, "package.json"), "utf8"));
const entry = packageJson.exports?.["."]?.import ?? packageJson.main;
const {getLlama} = await import(pathToFileURL(path.join(packageDir, entry)).href);

// build: "never" uses the prebuilt binaries shipped in the npm package, and never compiles llama.cpp here.
const llama = await getLlama({gpu: false, build: "never", maxThreads: threads, logLevel: "error"});
const model = await llama.loadModel({modelPath, gpuLayers: 0});
const context = await model.createContext({
    contextSize, batchSize: Math.min(512, contextSize), sequences: 1, threads: {ideal: threads, min: threads},
});
const sequence = context.getSequence();
const eos = new Set([model.tokens.eos, model.tokens.eot].filter((t) => t != null));

function reply(value) {
    process.stdout.write("@@ " + JSON.stringify(value) + "\n");
}

async function generate({prompt, new_tokens: newTokens, stop_at_eos: stopAtEos}) {
    await sequence.clearHistory();
    const tokens = [];
    const start = performance.now();
    const times = [0];
    // temperature 0: greedy. EOS is yielded (and, unless stop_at_eos, decoding goes on past it, as a generate with
    // eos_token_id=None does on the Python side: the speed is what is measured then).
    for await (const token of sequence.evaluate(prompt, {temperature: 0, yieldEogToken: true})) {
        times.push((performance.now() - start) / 1000);
        tokens.push(token);
        if (tokens.length >= newTokens || (stopAtEos && eos.has(token))) break;
    }
    return {tokens, times};
}

async function nll({tokens}) {
    // One batch over the window: the full next-token distribution after every position but the last (temperature
    // 1, no top-k/top-p/min-p: the model's softmax), and -log p of the token that follows.
    await sequence.clearHistory();
    const sampling = {temperature: 1, topK: 0, topP: 1, minP: 0};
    const input = tokens.map((token, i) => (i + 1 < tokens.length ? [token, {generateNext: {probabilities: true, options: sampling}}] : token));
    const results = await sequence.controlledEvaluate(input);
    let total = 0;
    let count = 0;
    for (let i = 0; i + 1 < tokens.length; i++) {
        const p = results[i]?.next?.probabilities?.get(tokens[i + 1]);
        if (p === undefined) throw new Error(`no probability for token ${tokens[i + 1]} at position ${i}`);
        total += -Math.log(Math.max(p, 1e-30));
        count++;
    }
    return {nll: total, count};
}

const handlers = {
    info: async () => ({
        release: llama.llamaCppRelease, system_info: llama.systemInfo, cpu_math_cores: llama.cpuMathCores,
        threads, context_size: context.contextSize, package: `node-llama-cpp ${packageJson.version}`,
    }),
    generate,
    nll,
    rss: async () => ({peak_rss: process.resourceUsage().maxRSS * 1024}),
};

reply({ready: true});
const lines = readline.createInterface({input: process.stdin});
for await (const line of lines) {
    if (!line.trim()) continue;
    const command = JSON.parse(line);
    if (command.op === "quit") break;
    try {
        const handler = handlers[command.op];
        if (!handler) throw new Error(`unknown op ${command.op}`);
        reply(await handler(command));
    } catch (error) {
        reply({error: String(error?.stack ?? error)});
    }
}
await context.dispose();
await model.dispose();
await llama.dispose();
