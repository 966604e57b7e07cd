// The theme chosen with the toggle (else the system's, by prefers-color-scheme), set before the first paint.
// A classic script in <head>: the page's modules run only after the document is parsed.
const theme = localStorage.getItem("gem4.theme");
if (theme === "light" || theme === "dark") document.documentElement.dataset.theme = theme;
