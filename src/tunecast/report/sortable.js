// Sorting a table by the clicked column (or Enter on a focused heading): numbers as numbers, a cell's data-value
// when it has one (so "$1,234.50" sorts by its amount). Inlined in the HTML reports and served to the web planner.
function sortableTable(table) {
  table.querySelectorAll("th").forEach(function (head, column) {
    head.setAttribute("tabindex", "0");
    function sort() {
      var ascending = head.getAttribute("aria-sort") !== "ascending";
      table.querySelectorAll("th").forEach(function (other) { other.removeAttribute("aria-sort"); });
      head.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      var body = table.tBodies[0];
      var rows = Array.prototype.slice.call(body.rows);
      function key(row) {
        var cell = row.cells[column];
        var raw = cell.hasAttribute("data-value") ? cell.getAttribute("data-value") : cell.textContent;
        var number = parseFloat(raw);
        return isNaN(number) ? raw.toLowerCase() : number;
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (x === y) { return 0; }
        return (x < y ? -1 : 1) * (ascending ? 1 : -1);
      });
      rows.forEach(function (row) { body.appendChild(row); });
    }
    head.addEventListener("click", sort);
    head.addEventListener("keydown", function (event) { if (event.key === "Enter") { sort(); } });
  });
}
