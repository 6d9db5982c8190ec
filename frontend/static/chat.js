// The chat page: the conversation lives here; each turn is one streamed
// POST /v1/chat/completions with the whole history, and the server applies the chat template.
"use strict";

const history = [];  // {role, content} of the finished turns, oldest first
let controller = null;  // the AbortController of the answer being streamed
let imageUrl = null;  // the attached image as a data: URL, sent with the next question

const el = (id) => document.getElementById(id);

function addMessage(role, text, image = null) {
  const message = document.createElement("div");
  message.className = `message ${role}`;
  if (image) {
    const thumbnail = document.createElement("img");
    thumbnail.className = "image-preview";
    thumbnail.src = image;
    message.append(thumbnail);
  }
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  message.append(body);
  el("messages").append(message);
  message.scrollIntoView({ block: "end" });
  return message;
}

function setStatus(text, isError = false) {
  el("status").textContent = text;
  el("status").classList.toggle("error", isError);
}

function setBusy(isBusy) {
  el("send").disabled = isBusy;
  el("stop").disabled = !isBusy;
}

// The schema box as OpenAI's response_format, or null when empty; throws on bad JSON.
function responseFormat() {
  const text = el("json-schema").value.trim();
  if (!text) return null;
  let schema;
  try {
    schema = JSON.parse(text);
  } catch (e) {
    throw new Error(`the JSON schema is not valid JSON: ${e.message}`);
  }
  return { type: "json_schema", json_schema: { name: "answer", schema } };
}

function requestBody() {
  const messages = [];
  const system = el("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...history);
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat(el("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt(el("max-tokens").value, 10);
  if (!Number.isNaN(maxTokens)) body.max_tokens = maxTokens;
  const format = responseFormat();
  if (format) body.response_format = format;
  return body;
}

async function send() {
  const text = el("prompt").value.trim();
  if (!text || controller) return;
  const image = imageUrl;
  // With an image, OpenAI's content parts: the image first, as SmolVLM's examples put it.
  history.push({ role: "user", content: image ? [{ type: "image_url", image_url: { url: image } },
    { type: "text", text }] : text });
  let body;
  try {
    body = requestBody();
  } catch (e) {
    history.pop();
    setStatus(e.message, true);
    return;
  }
  el("prompt").value = "";
  attachImage(null);
  const userMessage = addMessage("user", text, image);
  const answer = addMessage("assistant", "");
  answer.classList.add("streaming");
  const answerText = answer.querySelector(".text");
  controller = new AbortController();
  setBusy(true);
  setStatus("waiting for the first token…");
  let content = "";
  let finish = null;
  let usage = null;
  const started = performance.now();
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: tokenloom.headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      const message = await tokenloom.errorMessage(response);
      if (response.status === 401) tokenloom.askKey("The server refused the key; enter it again.");
      throw new Error(message);
    }
    await tokenloom.readEvents(response, (data) => {
      if (data.error) throw new Error(data.error.message);
      if (data.usage) usage = data.usage;
      for (const choice of data.choices || []) {
        const delta = choice.delta || {};
        if (delta.content) {
          content += delta.content;
          answerText.textContent = content;
          answer.scrollIntoView({ block: "end" });
          setStatus("streaming…");
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    });
    const seconds = (performance.now() - started) / 1000;
    const tokens = usage ? usage.completion_tokens : null;
    setStatus(tokens === null ? `done (${finish})`
      : `${tokens} tokens in ${seconds.toFixed(1)} s (${(tokens / seconds).toFixed(1)} tokens/s), finish: ${finish}`);
  } catch (e) {
    if (e.name === "AbortError") {
      finish = "stopped";
      setStatus("stopped");
    } else {
      finish = "error";
      setStatus(e.message, true);
    }
  } finally {
    answer.classList.remove("streaming");
    answer.dataset.finish = finish || "";
    if (content) {
      history.push({ role: "assistant", content });
    } else {
      // Nothing came back: take the question out of the history and give it back to edit.
      history.pop();
      userMessage.classList.add("failed");
      if (finish === "error") answer.remove();
      el("prompt").value = text;
      attachImage(image);
    }
    controller = null;
    setBusy(false);
  }
}

function attachImage(url) {
  imageUrl = url;
  el("image-preview").hidden = !url;
  if (url) el("image-preview").src = url;
  else el("image-preview").removeAttribute("src");
  if (!url) el("image").value = "";
}

function readImage(file) {
  if (!file) return;
  if (!file.type.startsWith("image/")) {
    setStatus(`${file.name} is not an image`, true);
    return;
  }
  const reader = new FileReader();
  reader.onload = () => attachImage(reader.result);
  reader.readAsDataURL(file);
}

el("image").addEventListener("change", () => readImage(el("image").files[0]));
el("image-preview").addEventListener("click", () => attachImage(null));  // a click takes it off again
el("composer").addEventListener("dragover", (event) => event.preventDefault());
el("composer").addEventListener("drop", (event) => {
  event.preventDefault();
  readImage(event.dataTransfer.files[0]);
});
el("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
el("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    send();
  }
});
el("stop").addEventListener("click", () => {
  if (controller) controller.abort();
});
el("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  attachImage(null);
  el("messages").replaceChildren();
  setStatus("");
});
tokenloom.setUpKeyForm(() => el("prompt").focus());
if (!tokenloom.needsKey || tokenloom.apiKey()) el("prompt").focus();
