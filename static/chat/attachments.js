// Images attached to the message being written: picked with the Attach button, pasted into the
// message box or dropped on the page; shown as thumbnails above the composer until sent or removed.
// Each is kept as a data: URL (what the API takes), scaled down first when its longest side is over
// MAX_SIDE, so that a saved conversation stays within the browser's storage.
"use strict";

const MAX_SIDE = 1536; // above every projector's input size, so scaling loses nothing the model sees
const MAX_IMAGES = 8; // the server's limit a request

export class Attachments {
  constructor({ strip, picker, button, dropZone, pasteTarget, failed }) {
    this.urls = [];
    this.strip = strip;
    this.failed = failed;
    button.addEventListener("click", () => picker.click());
    picker.addEventListener("change", () => {
      this.addFiles(picker.files);
      picker.value = "";
    });
    pasteTarget.addEventListener("paste", (e) => {
      const files = [...(e.clipboardData ? e.clipboardData.files : [])].filter((f) => f.type.startsWith("image/"));
      if (files.length) {
        e.preventDefault();
        this.addFiles(files);
      }
    });
    dropZone.addEventListener("dragover", (e) => e.preventDefault());
    dropZone.addEventListener("drop", (e) => {
      e.preventDefault();
      this.addFiles(e.dataTransfer ? e.dataTransfer.files : []);
    });
  }

  async addFiles(files) {
    for (const file of files) {
      if (!file.type.startsWith("image/")) {
        this.failed(`${file.name} is not an image.`);
        continue;
      }
      if (this.urls.length >= MAX_IMAGES) {
        this.failed(`A message takes at most ${MAX_IMAGES} images.`);
        break;
      }
      try {
        this.urls.push(await scaledDataUrl(file));
      } catch (_) {
        this.failed(`${file.name} could not be read as an image.`);
      }
    }
    this.render();
  }

  // The attached images' data URLs, emptying the strip.
  take() {
    const urls = this.urls;
    this.urls = [];
    this.render();
    return urls;
  }

  render() {
    this.strip.replaceChildren();
    this.strip.hidden = !this.urls.length;
    this.urls.forEach((url, i) => {
      const item = document.createElement("figure");
      const img = document.createElement("img");
      img.src = url;
      img.alt = `Attached image ${i + 1}`;
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "secondary remove";
      remove.textContent = "×";
      remove.setAttribute("aria-label", `Remove attached image ${i + 1}`);
      remove.addEventListener("click", () => {
        this.urls.splice(i, 1);
        this.render();
      });
      item.append(img, remove);
      this.strip.append(item);
    });
  }
}

function readAsDataUrl(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

async function scaledDataUrl(file) {
  const bitmap = await createImageBitmap(file); // rejects what the browser cannot decode
  const scale = Math.min(1, MAX_SIDE / Math.max(bitmap.width, bitmap.height));
  if (scale === 1) {
    bitmap.close();
    return readAsDataUrl(file);
  }
  const canvas = document.createElement("canvas");
  canvas.width = Math.round(bitmap.width * scale);
  canvas.height = Math.round(bitmap.height * scale);
  canvas.getContext("2d").drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  bitmap.close();
  return canvas.toDataURL("image/jpeg", 0.92);
}

// A message's content as the API takes it: its text, then its images as image_url parts.
export function apiContent(message) {
  if (!message.images || !message.images.length) return message.content;
  const parts = message.content ? [{ type: "text", text: message.content }] : [];
  return parts.concat(message.images.map((url) => ({ type: "image_url", image_url: { url } })));
}
