// Shared by the chat page and the dashboard: the API key and a server-sent-events reader.
// Plain JS, no dependency: the server ships this file as it is.
"use strict";

const KEY_STORAGE = "tokenloom-api-key";

const tokenloom = {
  needsKey: document.body.dataset.needsKey === "true",

  apiKey() {
    return localStorage.getItem(KEY_STORAGE) || "";
  },

  setApiKey(key) {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  },

  // Headers for every call the pages make; the key goes only where the server wants one.
  headers(extra = {}) {
    const key = this.apiKey();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : { ...extra };
  },

  // The error message of a failed response: the server's {"error": {"message"}} when it sent one.
  async errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
    } catch (_) { /* not JSON */ }
    return `${response.status} ${response.statusText}`;
  },

  // Read a text/event-stream body, calling onData(parsed JSON) per `data:` event until
  // `[DONE]` or the end. fetch rather than EventSource: EventSource cannot send the key.
  async readEvents(response, onData) {
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event.split("\n").filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  },

  // The key form shared by both pages: shown when the server wants a key we do not have
  // (or just refused ours); `onSaved` runs once a key is entered.
  setUpKeyForm(onSaved) {
    const form = document.getElementById("key-form");
    const input = document.getElementById("api-key");
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.setApiKey(input.value.trim());
      form.hidden = true;
      onSaved();
    });
    document.getElementById("key-button").addEventListener("click", () => this.askKey());
    if (!this.needsKey) document.getElementById("key-button").hidden = true;
    if (this.needsKey && !this.apiKey()) this.askKey();
  },

  askKey(message) {
    const form = document.getElementById("key-form");
    document.getElementById("key-message").textContent = message || "This server wants an API key.";
    form.hidden = false;
    document.getElementById("api-key").focus();
  },
};
