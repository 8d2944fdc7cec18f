#include "chat/jinja.h"

#include "chat/jinja_eval.h"
#include "chat/jinja_parser.h"

namespace sparsemla::chat {

namespace {

std::string with_position(int line, int column, const std::string& message) {
  if (line <= 0) return message;
  return fmt::format("line {}, column {}: {}", line, column, message);
}

}  // namespace

TemplateError::TemplateError(int line_, int column_, const std::string& message_)
    : Error(with_position(line_, column_, message_)), line(line_), column(column_), message(message_) {}

Template::Template(std::shared_ptr<const jinja::Program> program) : program_(std::move(program)) {}

Template Template::parse(std::string_view source, const TemplateOptions& options) {
  try {
    return Template(jinja::parse_program(source, jinja::LexOptions{options.trim_blocks, options.lstrip_blocks}));
  } catch (const TemplateError&) {
    throw;
  } catch (const std::exception& e) {  // out of memory and the like: still a TemplateError
    throw TemplateError(0, 0, std::string("cannot parse the template: ") + e.what());
  }
}

std::string Template::render(const nlohmann::ordered_json& context) const {
  try {
    return jinja::Interpreter(*program_).render(context);
  } catch (const TemplateError&) {
    throw;
  } catch (const std::exception& e) {
    throw TemplateError(0, 0, std::string("cannot render the template: ") + e.what());
  }
}

}  // namespace sparsemla::chat
